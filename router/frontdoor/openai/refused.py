"""The fields of OpenAI's request bodies this server refuses on purpose, per endpoint, and why:
the one list of them.

A request carrying one gets a 400 whose message names the field and gives the reason
(``router.frontdoor.http_app`` asks ``refusal``); docs/api.md's tables say the same, and
``tests/integration/frontdoor/test_door_openai_spec.py`` checks that every field of OpenAI's
request bodies is either honoured or listed here. Any other undeclared field is refused too
(the request models forbid extras), but a field of OpenAI's API refused without being listed
here is a bug: honour it, or list it with a reason a caller can act on.
"""

from __future__ import annotations

__all__ = ["REFUSED_FIELDS", "refusal"]

_STORED = "stored completions (OpenAI's dashboard, evals, distillation) are not kept here"
_CHAT_REFUSED = {
    "audio": "audio output: a text model serves text only",
    "modalities": "output modalities other than the default text: a text model serves text "
                  "only (leave it out)",
    "functions": "OpenAI's deprecated spelling of tools: use tools",
    "function_call": "OpenAI's deprecated spelling of tool_choice: use tool_choice",
    "metadata": _STORED,
    "store": _STORED,
    "service_tier": "one tier of service here: leave it out",
    "prediction": "predicted outputs (speculative decoding from a given text) are not "
                  "implemented",
    "reasoning_effort": "not a reasoning model",
    "verbosity": "not a reasoning model",
    "web_search_options": "no web search here",
    "moderation": "no moderation model here",
    "safety_identifier": "not implemented: use user (recorded on the request's trace)",
    "prompt_cache_key": "prefix caching is automatic here (KV-aware routing), no key needed",
    "prompt_cache_options": "prefix caching is automatic here, not configured per request",
    "prompt_cache_retention": "prefix caching is automatic here, not configured per request",
}
REFUSED_FIELDS: dict[str, dict[str, str]] = {
    "/v1/completions": {"suffix": "fill-in-the-middle (text after the insertion) is not "
                                  "implemented"},
    "/v1/chat/completions": _CHAT_REFUSED,
}


def refusal(path: str, field: str) -> str | None:
    """Why ``field`` of a request to ``path`` is refused on purpose (``REFUSED_FIELDS``), or
    None when it is not a field refused on purpose."""
    return REFUSED_FIELDS.get(path, {}).get(field)
