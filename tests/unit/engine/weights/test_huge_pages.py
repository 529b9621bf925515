"""The CPU model's weights in one mapping advised for huge pages
(``engine.weights.huge_pages``): every weight moved, nothing changed, on by default."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant.layouts import QuantizedWeight
from engine.weights import huge_pages
from engine.weights.huge_pages import ENV, huge_page_eligible, move_weights_to_huge_pages

PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
MOVED = "in one mapping advised for huge pages"  # what move_weights_to_huge_pages logs


def _thp_allows_advice() -> bool:
    """The host's THP mode lets a mapping advised MADV_HUGEPAGE take huge pages."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def _weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and every quantized weight's tensors, by a name for the message."""
    out = {name: p.data for name, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        w = vars(mod).get("weight")
        if isinstance(w, QuantizedWeight):
            for f in ("data", "scale", "offset"):
                if getattr(w, f) is not None:
                    out[f"{mod_name}.weight.{f}"] = getattr(w, f)
    return out


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_every_weight_moves_and_nothing_changes(tiny_llama_dir, monkeypatch, quantization):
    monkeypatch.setenv(ENV, "0")  # built where they load, so that the move is this test's
    llm = LLM(str(tiny_llama_dir), quantization=quantization)
    model = llm.engine.runner.model
    before = {k: v.clone() for k, v in _weight_tensors(model).items()}
    tokens = _tokens(llm)
    monkeypatch.setenv(ENV, "1")
    arena = move_weights_to_huge_pages(model)
    assert arena is not None and arena.address % huge_pages.HUGE_PAGE == 0
    after = _weight_tensors(model)
    assert after.keys() == before.keys()
    if quantization == "int4":
        assert any(".weight.offset" in k for k in after)  # the quantized tensors were listed
    for name, t in after.items():
        assert arena.address <= t.data_ptr() < arena.address + arena.nbytes, name
        assert t.data_ptr() % huge_pages.ALIGN == 0, name
        assert torch.equal(t, before[name]), name
    assert huge_page_eligible(arena.address) == _thp_allows_advice()
    assert _tokens(llm) == tokens  # the fused step's address table follows the move
    assert llm.engine.block_manager.num_used_blocks == 0


def test_on_by_default_and_off_by_the_environment(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    caplog.set_level(logging.INFO, logger=huge_pages.__name__)
    llm = LLM(str(tiny_llama_dir))  # what LLM(dir) does: the weights go to the mapping
    embed = llm.engine.runner.model.embed.weight
    assert huge_page_eligible(embed.data_ptr()) == _thp_allows_advice()
    assert any(MOVED in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(ENV, "0")
    assert not huge_pages.enabled()
    assert move_weights_to_huge_pages(llm.engine.runner.model) is None
    caplog.clear()
    # Off: no mapping made (the weights stay where they were loaded). Not "their address is
    # in no advised mapping": a small tensor sits in the heap, whose flags depend on what the
    # process did before (a CI worker once found the tiny model's embedding in an eligible one)
    LLM(str(tiny_llama_dir))
    assert not any(MOVED in r.getMessage() for r in caplog.records)
