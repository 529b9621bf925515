"""GGUF quantized tensors loaded into engine.quant.layouts's layouts (engine.quant.gguf): each
supported type dequantizes to what the gguf package's own dequantization gives (exactly, or for
Q4_K within the fp16 rounding of its multiplied-out scales), on random blocks, quantized
blocks and the default model's tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.quant.gguf import SUPPORTED, from_gguf, permute_rows
from engine.quant.layouts import INT4_GROUP, QuantizedWeight

Q = gguf.GGMLQuantizationType
SHAPES = [(24, 256), (5, 512)]
# Byte offsets of each type's fp16 block fields (the rest of a block is quantized values).
FP16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2)}


def _random_raw(qtype, n, k, rng, lo=-12, hi=-2):
    """Random valid blocks ``[N, bytes_per_row]``: random bytes, with each fp16 field set to a
    finite value of either sign and magnitude in [2^lo, 2^hi] (normal fp16 numbers)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        mag = np.exp2(rng.uniform(lo, hi, blocks.shape[0]))
        val = (mag * rng.choice([-1.0, 1.0], blocks.shape[0])).astype(np.float16)
        blocks[:, at:at + 2] = val.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // block * block_bytes)


def _reference(raw, qtype, n, k):
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


def _check_layout(w, qtype, n, k):
    assert isinstance(w, QuantizedWeight) and w.shape == (n, k)
    assert w.scale.dtype == torch.float16
    if qtype == Q.Q8_0:
        assert w.kind == "int8" and w.data.dtype == torch.int8 and w.group == 32
        assert w.offset is None
    else:
        assert w.kind == "int4" and w.data.dtype == torch.uint8 and w.group == INT4_GROUP
        assert w.offset.dtype == torch.float16


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_exact_types_random_blocks(qtype, shape, flat):
    n, k = shape
    raw = _random_raw(qtype, n, k, np.random.default_rng(int(qtype) * 1000 + n))
    w = from_gguf(raw.reshape(-1) if flat else raw, qtype, shape)
    _check_layout(w, qtype, n, k)
    assert torch.equal(w.dequantize(), _reference(raw, qtype, n, k))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_exact_types_quantized_by_gguf(qtype, shape):
    n, k = shape
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(x, qtype)
    w = from_gguf(raw, qtype, shape)
    _check_layout(w, qtype, n, k)
    assert torch.equal(w.dequantize(), _reference(raw, qtype, n, k))


@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_q4_k_within_fp16_scale_rounding(shape, flat):
    n, k = shape
    raw = _random_raw(Q.Q4_K, n, k, np.random.default_rng(n), lo=-10, hi=-4)
    w = from_gguf(raw.reshape(-1) if flat else raw, Q.Q4_K, shape)
    _check_layout(w, Q.Q4_K, n, k)
    ref = _reference(raw, Q.Q4_K, n, k)
    diff = (w.dequantize() - ref).abs()
    # Rounding d * sc and dmin * mn to fp16 (relative error <= 2^-11 each, all normal numbers
    # here) moves a weight d * sc * q - dmin * mn by at most 2^-11 * (15 |d sc| + |dmin mn|);
    # both sides also round their fp32 result once (2^-23 |w| covers the two). Per element:
    sb = raw.reshape(-1, 144)
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(sb[:, 4:16].copy())
    per_block = 2.0**-11 * (15 * np.abs(d * sc) + np.abs(dmin * mn))  # [S, 8]
    bound = torch.from_numpy(np.repeat(per_block.reshape(n, k // 32), 32, axis=1))
    assert bool((diff <= bound + 2.0**-23 * ref.abs()).all())
    # ... and overall tight: within 2^-10 of the largest weight.
    assert diff.max().item() <= 2.0**-10 * ref.abs().max().item()
    assert diff.max().item() > 0  # random scales do round: the bound is what is tested


def test_q4_k_exact_when_scales_are_fp16_exact():
    # d = dmin = 1: every d * sc and dmin * mn is a small integer, so no rounding at all and
    # any nibble or scale unpacking mistake would show as an inequality.
    n, k = 6, 512
    raw = np.random.default_rng(7).integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    raw[:, 0:4] = np.array([1.0, 1.0], np.float16).view(np.uint8)
    w = from_gguf(raw, Q.Q4_K, (n, k))
    assert torch.equal(w.dequantize(), _reference(raw, Q.Q4_K, n, k))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.F16, Q.F32, Q.Q5_0, Q.Q5_K, Q.BF16])
def test_unsupported_types_return_none(qtype):
    assert qtype.name not in SUPPORTED
    assert from_gguf(np.zeros(64, np.uint8), qtype, (2, 256)) is None


def test_scale_overflowing_fp16_returns_none():
    raw = _random_raw(Q.Q4_0, 2, 64, np.random.default_rng(0))
    raw[0, 0:2] = np.array([10000.0], np.float16).view(np.uint8)  # -8 * d overflows fp16
    assert from_gguf(raw, Q.Q4_0, (2, 64)) is None
    raw = _random_raw(Q.Q4_K, 1, 256, np.random.default_rng(0))
    raw[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)
    raw[0, 4] = 63  # sub-block 0's scale: d * 63 overflows fp16
    assert from_gguf(raw, Q.Q4_K, (1, 256)) is None


def test_bad_sizes_raise():
    raw = _random_raw(Q.Q4_1, 4, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(raw, Q.Q4_1, (4, 96))
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(raw[:, :-1], Q.Q4_1, (4, 64))
    with pytest.raises(ValueError, match="whole blocks"):
        from_gguf(np.zeros(144, np.uint8), Q.Q4_K, (2, 128))  # K not a multiple of 256


def test_dtype_is_carried():
    raw = _random_raw(Q.Q4_1, 3, 64, np.random.default_rng(0))
    w = from_gguf(raw, Q.Q4_1, (3, 64), dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.dequantize().dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K])
def test_permute_rows_matches_permuting_dequantized_rows(qtype):
    n, k = 24, 256
    raw = _random_raw(qtype, n, k, np.random.default_rng(3), lo=-10, hi=-4)
    w = from_gguf(raw, qtype, (n, k))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    p = permute_rows(w, perm)
    assert p.kind == w.kind and p.group == w.group
    assert torch.equal(p.dequantize(), w.dequantize()[perm])
    with pytest.raises(ValueError, match="permutation"):
        permute_rows(w, perm[:-1])


@pytest.fixture(scope="module")
def default_reader():
    from engine.weights.resolve import default_gguf_path

    try:
        path = default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    return gguf.GGUFReader(path)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "token_embd.weight"])
def test_default_model_tensors_exact(default_reader, name):
    t = next(t for t in default_reader.tensors if t.name == name)
    n, k = tuple(reversed(t.shape.tolist()))
    w = from_gguf(t.data, t.tensor_type, (n, k))
    _check_layout(w, t.tensor_type, n, k)
    assert torch.equal(w.dequantize(), _reference(t.data, t.tensor_type, n, k))


def test_default_model_every_tensor_loads(default_reader):
    # Every quantized tensor of the default model loads (None only for fp ones).
    for t in default_reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        if t.tensor_type.name not in SUPPORTED:
            assert from_gguf(t.data, t.tensor_type, (1, 1)) is None
            continue
        assert from_gguf(t.data, t.tensor_type, shape).shape == shape
