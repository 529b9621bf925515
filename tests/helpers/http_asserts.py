"""What a refused HTTP request must look like to a client."""

from __future__ import annotations


def assert_400_naming(r, field: str) -> dict:
    """``r`` is a 400 whose OpenAI error names ``field`` (as ``param`` or as the message's
    first word); returns the error object."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param") == field or err["message"].startswith(field), err
    return err


def assert_openai_error(r, status: int) -> dict:
    """``r`` has ``status`` and an OpenAI error body (a message and a type); returns the error
    object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err
