"""Tensor parallelism in the engine (CPU, gloo, one real process per extra rank): greedy
tokens equal transformers' at TP 1 / 2 / 4, with KV heads sharded and replicated, an uneven
vocabulary split, and a Qwen2 bias; the engine's features (chunked prefill, preemption,
prefix cache, logprobs, prompt logprobs) give TP 1's answers; the KV pool is per rank; an
impossible split is a start-up error; a rank that dies ends the engine, and no rank outlives
its engine."""

from __future__ import annotations

import gc
import math
import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.parallel.sharding import TPShard
from tests.helpers.quantized import dequantized_hf, near_greedy_misses
from tests.helpers.tiny_models import VOCAB, hf_greedy, random_prompts, save_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# One thread a rank (a 2-core host's share anyway): its kernel timing at start-up takes ~0.5 s,
# where on more threads of a busy host it took 10-15 s. Small pools: a few short prompts.
FAST = dict(num_threads=1, kv_cache_memory_bytes=1 << 22)


def _cfg(heads: int, kv_heads: int, vocab: int = 259, inter: int = 128) -> ModelConfig:
    return ModelConfig("llama", vocab, 64, inter, 2, heads, kv_heads, 64 // heads, 512)


# ---- the sharding (pure) ----------------------------------------------------------------------
def test_kv_heads_follow_their_query_heads_and_replicate_below_one_per_rank():
    cfg = _cfg(heads=8, kv_heads=2)
    assert [list(TPShard(r, 2).kv_heads(cfg)) for r in range(2)] == [[0], [1]]
    # 4 ranks, 2 KV heads: ranks 0-1 read head 0 (their query heads 0-3), ranks 2-3 head 1.
    assert [list(TPShard(r, 4).kv_heads(cfg)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(TPShard(r, 4).q_heads(cfg)) for r in range(4)] == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    local = TPShard(3, 4).local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    assert (local.hidden_size, local.vocab_size) == (64, 259)


def test_the_vocabulary_split_covers_every_token_once_even_when_uneven():
    cfg = _cfg(heads=4, kv_heads=4, vocab=259)
    parts = [TPShard(r, 4).vocab(cfg) for r in range(4)]
    assert [len(p) for p in parts] == [65, 65, 65, 64]
    assert [t for p in parts for t in p] == list(range(259))


def test_each_tensor_is_cut_where_megatron_cuts_it():
    cfg = _cfg(heads=4, kv_heads=2)  # head_dim 16
    s = TPShard(1, 2)
    assert s.slice_of("model.layers.0.self_attn.q_proj.weight", cfg) == (0, 32, 64)
    assert s.slice_of("model.layers.0.self_attn.k_proj.bias", cfg) == (0, 16, 32)
    assert s.slice_of("model.layers.0.self_attn.o_proj.weight", cfg) == (1, 32, 64)
    assert s.slice_of("model.layers.1.mlp.gate_proj.weight", cfg) == (0, 64, 128)
    assert s.slice_of("model.layers.1.mlp.down_proj.weight", cfg) == (1, 64, 128)
    assert s.slice_of("lm_head.weight", cfg) == (0, 130, 259)
    for whole in ("model.embed_tokens.weight", "model.norm.weight",
                  "model.layers.0.input_layernorm.weight"):
        assert s.slice_of(whole, cfg) is None
    assert TPShard(0, 1).slice_of("model.layers.0.self_attn.q_proj.weight", cfg) is None


def test_kv_heads_that_ranks_do_not_divide_split_by_group_unevenly():
    """SmolLM2-135M's shape: 9 query heads over 3 KV heads, TP 2: 2 groups + 1 group."""
    cfg = _cfg(heads=9, kv_heads=3, inter=1536)
    assert [list(TPShard(r, 2).kv_heads(cfg)) for r in range(2)] == [[0], [1, 2]]
    assert [list(TPShard(r, 2).q_heads(cfg)) for r in range(2)] == [[0, 1, 2],
                                                                     [3, 4, 5, 6, 7, 8]]
    assert [len(TPShard(r, 2).intermediate(cfg)) for r in range(2)] == [768, 768]
    assert TPShard(0, 2).max_kv_heads(cfg) == 2
    TPShard(0, 3).check(cfg)  # one group each


@pytest.mark.parametrize("cfg,size,named", [
    (_cfg(heads=4, kv_heads=2), 3, "2 KV heads"),
    (_cfg(heads=8, kv_heads=4, inter=4), 8, "intermediate size 4"),
    (_cfg(heads=12, kv_heads=3), 4, "3 KV heads"),
    (_cfg(heads=4, kv_heads=2), 8, "4 attention heads"),
])
def test_an_impossible_split_names_the_dimension(cfg, size, named):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} does not divide .*{named}"):
        TPShard(0, size).check(cfg)


# ---- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide_kv_dir(tmp_path_factory):
    """8 query heads over 4 KV heads (sharded, never replicated up to TP 4), and a vocabulary
    four ranks split unevenly."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-8q4kv"),
                           num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB + 3)


@pytest.fixture(scope="module")
def smol_shape_dir(tmp_path_factory):
    """The default model's attention shape in miniature: 9 query heads over 3 KV heads, which
    2 ranks split unevenly (2 groups + 1), and an intermediate size 2 ranks split evenly but
    3 do not (50 = 16 + 17 + 17)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-9q3kv"), hidden_size=72,
                           num_attention_heads=9, num_key_value_heads=3, intermediate_size=50)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(seed=3, count=6, max_len=40)


def _pids_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("model,arch,sizes", [
    ("tiny_llama_dir", "llama", (1, 2, 4)),  # 4 query heads over 2 KV heads: TP 4 replicates
    ("wide_kv_dir", "llama", (2, 4)),
    ("tiny_qwen2_dir", "qwen2", (2,)),  # Q/K/V biases cut with their rows
    ("tiny_qwen3_dir", "qwen3", (1, 2)),  # q/k norms: in the fused step at TP 1, replicated at 2
    ("tiny_phi3_dir", "phi3", (1, 2, 4)),  # fused qkv / gate_up: each part's rows per rank
    ("tiny_mixtral_dir", "mixtral", (1, 2)),  # every expert cut like the MLP; router replicated
    ("tiny_qwen2_moe_dir", "qwen2_moe", (1, 2)),  # + a shared expert cut by its own size
    ("tiny_qwen3_moe_dir", "qwen3_moe", (1, 2)),
    # norms around attention and the MLP on the all-reduced sums, logits soft-capped per rank
    ("tiny_gemma2_dir", "gemma2", (2,)),
    ("tiny_gemma3_dir", "gemma3", (2,)),  # + windows, two RoPE bases, q/k norms replicated
    ("smol_shape_dir", "llama", (2, 3)),  # uneven head and intermediate splits
])
def test_greedy_tokens_equal_transformers_at_every_tp(request, model, arch, sizes, prompts):
    model_dir = request.getfixturevalue(model)
    refs = hf_greedy(model_dir, arch, prompts, MAX_TOKENS)
    for size in sizes:
        with LLM(str(model_dir), tensor_parallel_size=size, **FAST) as llm:
            outs = llm.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == refs, f"tensor_parallel_size={size}"
            bm = llm.engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks  # nothing leaked on rank 0's books
            pids = list(llm.engine.ranks.pids) if llm.engine.ranks else []
            assert len(pids) == size - 1
        assert _pids_gone(pids), "a rank outlived its engine"


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_mixtral_dir"])
def test_quantized_ranks_quantize_their_shards_to_tp1s_weights(request, model, prompts,
                                                               tmp_path):
    """``--quantization int8`` at TP 2: each rank quantizes its own slices (O and down cut
    along their input at multiples of the 32-weight group, every expert too), so the ranks
    hold TP 1's quantized weights between them: both sizes generate the greedy tokens of
    transformers on those weights dequantized, up to near-ties (where a plan rounds
    activations to int8, a rank rounds its slice of a row by that slice's own largest value:
    TP 1 and TP 2 may part at a near-tie, ``NEAR_GREEDY_TOL``)."""
    model_dir = request.getfixturevalue(model)
    hf = dequantized_hf(model_dir, model.removeprefix("tiny_").removesuffix("_dir"), "int8",
                        tmp_path / "deq")
    for size in (1, 2):
        with LLM(str(model_dir), tensor_parallel_size=size, quantization="int8", **FAST) as llm:
            assert llm.engine.model.quantization == "int8"
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert near_greedy_misses(hf, prompts, tokens) == [], f"TP {size}"


def test_a_gguf_splits_its_blocks_between_ranks(tmp_path, prompts):
    """``--quantization auto`` on a GGUF at TP 2 serves its blocks (``gguf``): each rank reads
    its rows of every block tensor and its blocks of the row-parallel ones (O in Q4_0, down in
    Q4_K, cut at 32-weight blocks), so both sizes generate the greedy tokens of transformers on
    the conversion's fp32 weights (the same blocks dequantized). Untuned (tune_kernels off):
    what is checked is which blocks each rank holds, so every product is the exact float one
    (``cquant``), not the host's integer products (tests/unit/engine/ops/test_int_products.py)."""
    from engine.weights.loader import load_quantized_state_dict
    from engine.weights.resolve import resolve_model
    from tests.helpers.gguf_files import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    model_dir = resolve_model(str(gguf), cache_dir=cache).model_dir
    refs = hf_greedy(model_dir, "llama", prompts, MAX_TOKENS)
    for size in (1, 2):
        with LLM(str(gguf), tensor_parallel_size=size, cache_dir=str(cache), tune_kernels=False,
                 **FAST) as llm:
            model = llm.engine.model
            # Q4_0 / Q4_K layers and the Q8_0 table; at TP 2 the tied table is held in fp
            # (each rank's vocabulary rows of the head are cut from it: engine.models.llama)
            assert model.quantization == ("int4+int8" if size == 1 else "int4")
            if size == 2:  # rank 0 holds half of O's input blocks, all of its rows
                whole = load_quantized_state_dict(model_dir)["model.layers.0.self_attn.o_proj.weight"]
                o = model.layers[0].o_proj.weight
                assert o.shape == (whole.shape[0], whole.shape[1] // 2)
                assert torch.equal(o.dequantize(), whole.dequantize()[:, :whole.shape[1] // 2])
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert tokens == refs, f"TP {size}"


def test_tp2_serves_every_engine_feature_as_tp1_does(wide_kv_dir, prompts):
    """Chunked prefill, preemption, the prefix cache, logprobs and prompt logprobs at TP 2:
    the same tokens as TP 1 and the same numbers (to float rounding: the sums run in another
    order)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    setup = dict(FAST, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    shared = prompts[0][:24]
    batch = [*prompts, shared + [5, 6], shared + [7, 8]]
    runs = {}
    for size in (1, 2):
        with LLM(str(wide_kv_dir), tensor_parallel_size=size, **setup) as llm:
            runs[size] = llm.generate(batch, params)
            # (prompt logprobs need every position computed: these two ask for none)
            first = llm.generate([shared + [9]], GREEDY)[0]
            again = llm.generate([shared + [9]], GREEDY)[0]
            assert again.metrics.num_cached_tokens >= 16  # served from the prefix cache
            assert again.token_ids == first.token_ids
            assert llm.engine.scheduler.num_steps > len(batch)  # prompts were chunked
            assert llm.engine.block_manager.num_used_blocks == 0
    for one, two in zip(runs[1], runs[2], strict=True):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)


def test_the_kv_pool_is_per_rank(wide_kv_dir):
    """Each rank holds only its KV heads, so the same per-rank budget holds TP x the blocks
    (4 KV heads: 2 per rank at TP 2)."""
    blocks = {}
    for size in (1, 2):
        with LLM(str(wide_kv_dir), tensor_parallel_size=size, **FAST) as llm:
            blocks[size] = llm.engine.block_manager.num_blocks
    assert blocks[2] == 2 * blocks[1]


def test_an_impossible_split_fails_before_any_rank_starts(tiny_llama_dir):
    children_before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **FAST)
    assert _children() == children_before


def _is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"engine.runtime.tp_follower" in f.read()
    except OSError:
        return False


def test_cuda_graphs_asked_for_with_tp_are_refused_not_dropped(tiny_llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs=True: not with tensor_parallel_size > 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, cuda_graphs=True, **FAST)


def _children() -> set[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as f:
        return {int(p) for p in f.read().split()}


def test_a_rank_that_dies_before_joining_fails_start_up_at_once(tiny_llama_dir):
    """Killed while it starts (importing torch takes it a second or more): the engine's
    constructor names the rank and its exit code well before the join's 120 s timeout."""
    import threading

    before = _children()
    killed: list[int] = []

    def kill_the_new_rank() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for pid in _children() - before:
                if _is_rank(pid):  # not, e.g., the shared memory's resource tracker
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_new_rank)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9 before"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, **FAST)
    killer.join()
    assert killed and time.monotonic() - t0 < 20
    assert not [pid for pid in _children() if _is_rank(pid)]


def test_a_rank_that_dies_ends_the_engine_with_a_clear_error(tiny_llama_dir, prompts):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=4, **FAST)
    pids = list(llm.engine.ranks.pids)
    assert llm.generate(prompts[:1], GREEDY)[0].token_ids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError):
        llm.generate(prompts[:1], GREEDY)
    with pytest.raises(RuntimeError, match="a tensor-parallel rank failed"):
        llm.engine.step() if llm.engine.has_unfinished_requests else llm.generate(
            prompts[:1], GREEDY)
    assert _pids_gone(pids), "the surviving ranks were not ended"


def test_a_dropped_engine_ends_its_ranks_and_removes_its_shared_memory(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **FAST)
    pids = list(llm.engine.ranks.pids)
    segment = llm.engine.ranks.comm.shm.name  # CPU ranks all-reduce through it
    assert segment in os.listdir("/dev/shm")
    del llm
    gc.collect()
    assert _pids_gone(pids)
    assert segment not in os.listdir("/dev/shm")


# ---- KV between engines of different TP sizes --------------------------------------------------
def _engine(model_dir, tp: int, **kw):
    from engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=str(model_dir), detokenize=False, tensor_parallel_size=tp,
                                **{**FAST, **kw}))


def _export(model_dir, tp: int, prompts, export_from=None, **kw) -> tuple[dict, list]:
    """Prefill each prompt on a TP ``tp`` engine as a one-token export; first tokens and the
    exported layers."""
    eng = _engine(model_dir, tp, **kw)
    try:
        exports: list = []
        eng.kv_connector.exporter = exports.append
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(p, one, request_id=f"r{i}", export_kv=True,
                            export_from=(export_from or {}).get(f"r{i}", 0))
        first = {}
        while eng.has_unfinished_requests:
            for out in eng.step():
                if out.finished:
                    first[out.request_id] = out.token_ids[0]
        assert eng.stats().kv_blocks_used == 0
        return first, exports
    finally:
        eng.close()


def _decode(eng, prompts, first, exports) -> list[list[int]]:
    conn = eng.kv_connector
    for i, p in enumerate(prompts):
        assert conn.reserve(f"r{i}", p, GREEDY).ok
    for e in exports:
        conn.import_layer(e.request_id, e.layer, e.kv)
    outs = {f"r{i}": [first[f"r{i}"]] for i in range(len(prompts))}
    for rid in outs:
        assert not conn.admit(rid, outs[rid][0]).finished
    while eng.has_unfinished_requests:
        for out in eng.step():
            outs[out.request_id].extend(out.new_token_ids)
    assert eng.stats().kv_blocks_used == 0
    return [outs[f"r{i}"][:MAX_TOKENS] for i in range(len(prompts))]


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [
    ("tiny_llama_dir", 2, 1), ("tiny_llama_dir", 1, 2), ("tiny_llama_dir", 2, 4),
    ("tiny_llama_dir", 4, 2), ("smol_shape_dir", 2, 3),
])
def test_kv_moves_between_any_tp_sizes(request, model, prompts, prefill_tp, decode_tp):
    """The prefill engine's ranks gather their KV heads into the model's whole layout (TP 4
    replicates the 2 heads: each is taken once; 3 heads over 2 ranks: one rank pads); the
    decode engine's ranks each take theirs. Greedy tokens equal transformers', and the
    exported layers equal a TP 1 export's."""
    model_dir = request.getfixturevalue(model)
    refs = hf_greedy(model_dir, "llama", prompts, MAX_TOKENS)
    first, exports = _export(model_dir, prefill_tp, prompts)
    kv_heads = 3 if model == "smol_shape_dir" else 2
    assert all(e.kv.shape[2] == kv_heads for e in exports)  # every KV head, whatever the TP
    if prefill_tp != 1:
        _, single = _export(model_dir, 1, prompts[:1])
        mine = [e for e in exports if e.request_id == "r0"]
        for a, b in zip(mine, single, strict=True):
            assert torch.allclose(a.kv, b.kv, atol=1e-4)
    dec = _engine(model_dir, decode_tp)
    try:
        assert _decode(dec, prompts, first, exports) == refs
    finally:
        dec.close()


def test_int8_kv_moves_between_tp_sizes_as_stored(tiny_llama_dir, prompts):
    """An int8 KV cache under tensor parallelism, prefill TP != decode TP: TP 2 ranks gather
    their heads' int8 rows (values and scales) into the model's whole layout (a TP 1 export's
    within a quantization step), and a TP 2 decode engine takes a TP 1 prefill's rows, each
    rank its heads, as stored: the tokens equal a TP 1 int8 prefill and decode's."""
    from engine.attention.kv_format import dequantize_rows

    first, exports = _export(tiny_llama_dir, 2, prompts, kv_cache_dtype="int8")
    head_dim = 16
    assert all(e.kv.dtype == torch.int8 and e.kv.shape[2:] == (2, head_dim + 4)
               for e in exports)
    first1, single = _export(tiny_llama_dir, 1, prompts, kv_cache_dtype="int8")
    for a, b in zip([e for e in exports if e.request_id == "r0"],
                    [e for e in single if e.request_id == "r0"], strict=True):
        x, y = dequantize_rows(a.kv, torch.float32), dequantize_rows(b.kv, torch.float32)
        step = y.abs().amax(-1, keepdim=True) / 127
        assert bool(((x - y).abs() <= 2 * step + 1e-5).all())
    ref_engine = _engine(tiny_llama_dir, 1, kv_cache_dtype="int8")
    try:
        refs = _decode(ref_engine, prompts, first1, single)
    finally:
        ref_engine.close()
    assert first == first1
    dec = _engine(tiny_llama_dir, 2, kv_cache_dtype="int8")
    try:
        assert _decode(dec, prompts, first1, single) == refs
    finally:
        dec.close()


def _cache_prefix(dec, prefix, prompt):
    """Serve ``prefix`` on the decode engine ``dec`` (its blocks stay cached), then reserve
    and release ``prompt``: the reservation that says how many of its tokens ``dec`` holds."""
    dec.add_request(prefix, GREEDY, request_id="warm")
    while dec.has_unfinished_requests:
        dec.step()
    held = dec.kv_connector.reserve("r0", prompt, GREEDY)
    assert held.ok and held.num_cached_tokens >= 4
    dec.kv_connector.release("r0")
    return held


def test_an_int8_decode_engine_takes_only_the_rows_it_lacks(tiny_llama_dir, prompts):
    """Decode-side prefix reuse with an int8 cache: the decode engine holds a prompt's prefix
    in its own int8 blocks, the prefill sends the rest (``export_from``) as int8 rows, and
    the tokens equal the same int8 prefill and decode without the reuse."""
    prompt = prompts[0] + prompts[1]
    first, whole = _export(tiny_llama_dir, 1, [prompt], kv_cache_dtype="int8")
    ref_engine = _engine(tiny_llama_dir, 1, kv_cache_dtype="int8", block_size=4)
    try:
        refs = _decode(ref_engine, [prompt], first, whole)
    finally:
        ref_engine.close()
    dec = _engine(tiny_llama_dir, 1, kv_cache_dtype="int8", block_size=4)
    try:
        held = _cache_prefix(dec, prompts[0], prompt)
        first2, rest = _export(tiny_llama_dir, 1, [prompt], kv_cache_dtype="int8",
                               export_from={"r0": held.num_cached_tokens})
        assert all(e.kv.dtype == torch.int8
                   and e.kv.shape[1] == len(prompt) - held.num_cached_tokens for e in rest)
        assert _decode(dec, [prompt], first2, rest) == refs
    finally:
        dec.close()


def test_a_tp_decode_engine_reuses_its_prefix_cache_for_a_tp1_prefill(tiny_llama_dir, prompts):
    """Prefix reuse across TP sizes: the TP 2 decode engine caches a prompt's prefix; the
    TP 1 prefill then sends only the rest (``export_from``), and the tokens still equal
    transformers'."""
    prompt = prompts[0] + prompts[1]
    refs = hf_greedy(tiny_llama_dir, "llama", [prompt], MAX_TOKENS)
    dec = _engine(tiny_llama_dir, 2, block_size=4)
    try:
        held = _cache_prefix(dec, prompts[0], prompt)
        first, exports = _export(tiny_llama_dir, 1, [prompt],
                                 export_from={"r0": held.num_cached_tokens})
        assert all(e.kv.shape[1] == len(prompt) - held.num_cached_tokens for e in exports)
        assert _decode(dec, [prompt], first, exports) == refs
    finally:
        dec.close()
