"""The integer products (int8 activations x int8 / int4 weights, ``cqint``, on AMX tiles
``camx`` and on the weights' panels ``cqpanel``): every instruction path this host can run and the portable one against a reference
in torch, the whole-step decode kernel on them against the layer path, and the check that
keeps a build the host cannot execute out of the process. The AMX cases run where the host
grants AMX (``cpu_ops.amx_tiles``: the Intel Xeon hosts here), the panels' where the build has
them (AVX-512 VNNI, ``cpu_ops.panels_built``), and each says so where it does not."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch

from engine.attention.torch_paged import TorchPagedBackend, decode_tables
from engine.models.llama import LlamaForCausalLM
from engine.ops import cpu_build, cpu_ops, quant_ops
from engine.ops.linear import LINEAR_BUCKETS, LinearPlan, linear_plan, set_linear_plan, weight_key
from engine.quant.layouts import quantize
from engine.tuning.linear import model_linear_weights
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config
from tests.helpers.decode_step import BLOCK, five_rows

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="needs the C kernels")

# Against the same product in fp32 of the *rounded* activations: only the summation order
# differs (integer sums per block, then fp32).
RTOL = 2e-5
AVX2 = ("-mavx2", "-mfma", "-mf16c")


def _host_runs(flag: str) -> bool:
    return any(line.startswith("flags") and f" {flag}" in line
               for line in open("/proc/cpuinfo").read().splitlines())


@pytest.fixture(scope="module")
def builds():
    """isa name -> a loaded build of the kernels holding that path: this process's (the best
    the host runs), AVX2 where the host has it, and the portable one. The extra builds live in
    the kernels' own cache (keyed by source, flags and ladder), so a host compiles each once."""
    out = {cpu_ops.int_dot_isa(): cpu_ops.library()}
    ladders = {"portable": ((),)}
    if _host_runs("avx2"):
        ladders["avx2"] = (AVX2,)
    for name, ladder in ladders.items():
        lib = cpu_ops.load(cpu_ops.build(None, ladder))
        assert lib is not None and cpu_ops.ISA_NAMES[lib.qi_isa()] == name
        out[name] = lib
    return out


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it: per 32 values q = round(x * 127 / max|x|), times
    max|x| / 127."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127)).reshape(m, k)


def _reference(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """x rounded as the kernel rounds it, times the dequantized weight, in fp64."""
    xq = rounded(x)
    out = xq.double() @ w.dequantize().double().T
    return (out if bias is None else out + bias.double()).float()


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("isa", ["host", "amx", "panels", "avx2", "portable"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 32])
@pytest.mark.parametrize("n,k", [(40, 64), (17, 96), (9, 576), (22, 1568)],
                         ids=["pairs", "odd-blocks", "576", "1568-odd"])
def test_each_instruction_path_equals_the_rounded_reference(builds, isa, kind, m, n, k):
    """Every batch bucket (AMX: rows padded to its 16), K with an odd number of 32-weight
    blocks (the last pair alone), N not a multiple of the row tile (AMX: 16 weight rows a
    tile, the rest one at a time), a zero row of x (scale 0), a block with an outlier and a
    bias."""
    amx = isa == "amx"
    name = cpu_ops.int_dot_isa() if isa in ("host", "amx", "panels") else isa
    if (name not in builds or (amx and not cpu_ops.amx_tiles())
            or (isa == "panels" and not cpu_ops.panels_built())):
        pytest.skip(f"this host does not run {isa}")  # AVX2, AMX or the panels can be absent
    w = quantize(_rand(n, k) * 0.05, kind)
    x, bias = _rand(m, k, seed=1) * 3, _rand(n, seed=2)
    x[m // 2] = 0
    x[0, 5] = 400.0  # an outlier: its block's scale, not its row's neighbours'
    if isa == "panels":  # 16 weight rows a panel: N = 9, 17, 22 leave one short
        got = quant_ops.quantized_linear_panels(x, w, bias)
        assert w.panels is not None and quant_ops.panels(w) is w.panels  # made once, kept
    else:
        got = quant_ops.quantized_linear_int(x, w, bias, lib=builds[name], amx=amx)
    ref = _reference(x, w, bias)
    assert got is not None
    assert (got - ref).abs().max() <= RTOL * ref.abs().max(), name
    if m > 1:
        assert torch.equal(got[m // 2], bias)  # a zero row: scales 0, only the bias is left


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_activations_rounding_costs_what_is_stated(kind):
    """Against fp32 activations the only difference is x's rounding to 255 levels per 32
    values: within 1% of the largest output on random rows."""
    w = quantize(_rand(256, 576) * 0.05, kind)
    x = _rand(16, 576, seed=3)
    exact = x @ w.dequantize().T
    got = quant_ops.quantized_linear_int(x, w, None)
    assert (got - exact).abs().max() <= 0.01 * exact.abs().max()


def test_other_groups_are_declined():
    w = quantize(_rand(8, 64), "int8")
    w16 = type(w)("int8", w.data, w.scale.repeat_interleave(2, dim=1), None, 16)
    assert quant_ops.quantized_linear_int(_rand(2, 64), w16, None) is None
    assert quant_ops.quantized_linear_panels(_rand(2, 64), w16, None) is None
    assert w16.panels is None


def test_only_avx512_vnni_builds_hold_the_panels(builds):
    """The panels are AVX-512 VNNI code: the AVX2 and portable builds say they have none (the
    engine then never offers ``cqpanel`` or the ``qpanel`` step)."""
    for name, lib in builds.items():
        assert cpu_ops.panels_built(lib) == (name == "avx512-vnni"), name


def test_a_build_the_host_cannot_execute_is_refused(tmp_path, caplog):
    """The probe runs in a child: an instruction the host cannot execute kills the child
    (SIGILL; ud2 here stands for an AMX tile instruction on a VM without AMX state), and the
    build is not used."""
    src = tmp_path / "ill.c"
    src.write_text("int isa_probe(void) { __builtin_trap(); return 0; }\n")
    lib = tmp_path / "ill.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with caplog.at_level(logging.WARNING, logger="engine.ops.cpu_ops"):  # cpu_build logs there
        assert not cpu_build._probe(lib, ("-mamx-tile",))
    assert "SIGILL" in caplog.text and "-mamx-tile" in caplog.text


def test_a_rung_that_fails_falls_to_the_next(tmp_path):
    path = cpu_ops.build(tmp_path, (("-mno-such-instruction-set",), AVX2))
    lib = cpu_ops.load(path)
    assert lib is not None and lib.qi_isa() == 1  # the AVX2 rung


@pytest.fixture
def int_plan():
    """The linear plan in force swapped for one sending every quantized weight to ``path``."""
    held = linear_plan()
    yield lambda model, path: set_linear_plan(LinearPlan({
        (*weight_key(w)[:2], b, weight_key(w)[2]): path
        for w in model_linear_weights(model) for b in LINEAR_BUCKETS}))
    set_linear_plan(held)


@pytest.mark.parametrize("step", ["qint", "qamx", "qpanel"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_fused_step_on_integer_products_equals_the_layer_path(arch, kind, step, request,
                                                                  int_plan):
    """decode_layers' integer products (``qint``; ``qamx`` on AMX tiles; ``qpanel`` on the
    weights' panels) and the layer path with every quantized linear on ``cqint`` (``camx``,
    ``cqpanel``): the same math (each projection's
    input rounded per 32), so the same hidden states and the same new K/V, within fp32
    summation order."""
    amx = step == "qamx"
    if amx and not cpu_ops.amx_tiles():
        pytest.skip("this host does not run AMX tiles")
    if step == "qpanel" and not cpu_ops.panels_built():
        pytest.skip("this host's build has no panels (AVX-512 VNNI only)")
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(load_state_dict(model_dir, torch.float32))
    model.quantize(kind)
    int_plan(model, {"qint": "cqint", "qamx": "camx", "qpanel": "cqpanel"}[step])
    step_in = five_rows(cfg)
    block, caches, fused_caches = BLOCK, step_in.caches, step_in.fused_caches
    meta, ids = step_in.meta, step_in.ids
    backend = TorchPagedBackend()
    with torch.inference_mode():
        backend.plan(meta)
        ref = model(ids, meta.positions, caches, backend)
        got = model.decode_fused(ids, meta.positions, fused_caches, *decode_tables(meta), block,
                                 cpu_ops.NEVER_WIDE, int_products=True, amx=amx,
                                 panels=step == "qpanel")
        plain = model.decode_fused(ids, meta.positions, [c.clone() for c in caches],
                                   *decode_tables(meta), block, cpu_ops.NEVER_WIDE)
    assert got is not None
    assert (model._panel_table is not None) == (step == "qpanel")  # the panels' table ran
    # Within fp32 summation order, except where that order moves an activation across a
    # rounding of its int8 quantization (a norm summed in C vs in torch, then one value
    # rounded the other way: the AMD EPYC AVX2 host, qwen3's int4, one of the five rows).
    # Such a row may differ by what the integer products themselves change (|plain - ref|);
    # every other row, and at least four of five, agree to 1e-4.
    err = ((got - ref).abs() - 1e-4 - 1e-4 * ref.abs()).amax(dim=1)
    bound = (plain - ref).abs().amax(dim=1)
    flipped = err > 0
    assert int(flipped.sum()) <= 1, f"rows {flipped.nonzero().flatten().tolist()} differ"
    assert bool((err <= bound).all()), (err, bound)
    rows = step_in.slots
    for a, b in zip(fused_caches, caches, strict=True):
        # the new tokens' K/V (the slots of a flipped row within the same bound), and nothing
        # else written
        ok = ~flipped
        torch.testing.assert_close(a[rows[0][ok], :, rows[1][ok]], b[rows[0][ok], :, rows[1][ok]],
                                   atol=1e-5, rtol=1e-5)
        untouched = torch.ones(a.shape[0], block, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(a.transpose(1, 2)[untouched], b.transpose(1, 2)[untouched])
    assert not torch.equal(got, plain)  # it did take the integer products


def test_a_step_with_prompt_rows_multiplies_fp32_activations():
    """``exact_activations`` (a step holding prompt rows, engine.executor.model_runner): a plan's
    cqint gives way to a float path, so the product is the dequantized weight's exactly."""
    from engine.ops.linear import exact_activations, linear

    w = quantize(_rand(64, 96) * 0.05, "int4")
    held = linear_plan()
    try:
        for m in (3, 40):  # untimed: cquant up to 32 rows, dequant past them
            set_linear_plan(LinearPlan({(64, 96, b, "int4"): "cqint" for b in LINEAR_BUCKETS}))
            x = _rand(m, 96, seed=m)
            exact = x @ w.dequantize().T
            with exact_activations():
                got = linear(x, w)
            assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()
            assert torch.allclose(linear(x, w), _reference(x, w), rtol=0, atol=1e-4)  # outside
    finally:
        set_linear_plan(held)
