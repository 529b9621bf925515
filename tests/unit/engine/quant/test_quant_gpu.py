"""int4 on CUDA (``engine.quant.gpu``), the parts a CPU can check: our int4 layout maps onto
PyTorch's tinygemm operands with the same 4-bit values, and PyTorch's CPU twin of the CUDA
kernel (``_weight_int4pack_mm_for_cpu``, the same scales-and-zeros convention) multiplies them
into what our weights stand for, to the one rounding tinygemm adds (bf16 scales and zeros).
The CUDA kernel itself runs in ``tests/gpu/test_int4_cuda.py`` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.quant.gpu import inner_k_tiles, tinygemm_operands
from engine.quant.layouts import quantize

BF16_REL = 2.0 ** -8  # bf16 keeps 8 significant bits: round-to-nearest is within 2^-9 of each


@pytest.mark.parametrize("n,k", [(64, 576), (192, 576), (1536, 576), (576, 1536)])
def test_tinygemm_operands_multiply_to_our_int4_weights(n, k):
    torch.manual_seed(n + k)
    w = quantize(torch.randn(n, k) * 0.05, "int4")
    q, pairs = tinygemm_operands(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert pairs.shape == (k // 32, n, 2) and pairs.dtype == torch.bfloat16
    # tinygemm's weights: (q - 8) * scale + zero, per 32 inputs of a row
    scale = pairs[..., 0].float().T.repeat_interleave(32, dim=1)
    zero = pairs[..., 1].float().T.repeat_interleave(32, dim=1)
    theirs = (q.float() - 8) * scale + zero
    ours = w.dequantize()
    # the only difference is bf16's rounding of each group's scale and zero
    bound = BF16_REL * (8 * scale.abs() + zero.abs()) + 1e-7
    assert ((theirs - ours).abs() <= bound).all()
    x = torch.randn(5, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles(k))
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, pairs.float())
    torch.testing.assert_close(out, x @ theirs.T, rtol=1e-4, atol=1e-4)


def test_inner_k_tiles_is_the_widest_packing_that_divides_the_input():
    assert [inner_k_tiles(k) for k in (576, 1536, 64, 32, 2048)] == [4, 8, 4, 2, 8]
    assert inner_k_tiles(48) is None


def test_tinygemm_takes_only_int4_in_groups_of_32():
    with pytest.raises(ValueError, match="int4 weights in groups of 32, got int8"):
        tinygemm_operands(quantize(torch.randn(8, 64), "int8"))
