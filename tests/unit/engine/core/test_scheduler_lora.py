"""The running batch holds at most ``max_loras`` adapters, for requests whose prompt KV arrived
from a prefill worker (a disaggregated decode engine's) as for local ones: a transferred
request of another adapter waits, holding its pages, and runs once the running one finishes
(helpers and per-step checks: tests/unit/engine/core/test_scheduler.py)."""

from __future__ import annotations

from engine.contract import SamplingParams
from engine.core.request import Request
from engine.lora.request import LoRARequest
from tests.unit.engine.core.test_scheduler import EOS, make


def _transferred(h, rid: str, adapter: str | None, first: int, prompt_at: int) -> Request:
    """A request reserved as a decode engine reserves one, its KV arrived with ``first``."""
    req = Request(rid, list(range(prompt_at, prompt_at + 8)), SamplingParams(max_tokens=3),
                  arrival_time=h.clock(), eos_token_ids=(EOS,))
    if adapter is not None:
        req.lora_request = LoRARequest(adapter, ord(adapter), f"/adapters/{adapter}")
    assert h.sched.add_remote_request(req)
    h.sched.finish_remote_kv(rid, first)
    return req


def test_transferred_requests_of_another_adapter_wait_for_max_loras():
    h = make(block_size=4, max_loras=1)
    reqs = [_transferred(h, "a1", "a", 40, 100), _transferred(h, "b1", "b", 41, 200),
            _transferred(h, "base", None, 42, 300), _transferred(h, "a2", "a", 43, 400)]
    local = h.add("b2", 4, max_tokens=2)
    local.lora_request = LoRARequest("b", ord("b"), "/adapters/b")
    steps = []
    while h.sched.has_unfinished:
        out, _ = h.step()
        steps.append({(c.request_id, c.lora_name) for c in out.chunks})
        # waiting, not failed: the deferred request keeps its pages
        assert h.bm.has_request("b1") or reqs[1].is_finished
    h.assert_all_free()
    assert all(len({n for _, n in s} - {None}) <= 1 for s in steps)  # never two adapters
    first = steps[0]
    assert first == {("a1", "a"), ("base", None), ("a2", "a")}  # b1 waits; later ones pass
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert len(local.output_token_ids) == 2
    assert [r.status.finish_reason for r in reqs] == ["length"] * 4
