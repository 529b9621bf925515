"""Shared fixtures (tiny random Llama-family models saved to disk with transformers), and the
hooks that give back what finished tests held (see "Memory" in docs/testing.md)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny_models import GEMMA_WINDOW, save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    # head_dim 32 with 4 heads over hidden 64: Qwen3's heads are wider than hidden / heads
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"), head_dim=32)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory):
    # Phi-3's config pads with token 32000 by default: one inside the tiny vocabulary
    return save_tiny_model("phi3", tmp_path_factory.mktemp("tiny-phi3"), pad_token_id=0)


@pytest.fixture(scope="session")
def tiny_phi3_longrope_dir(tmp_path_factory):
    """Phi-3 with LongRoPE over an original context of 16: prompts and generations cross it,
    so both factor sets (and the attention factor, context 512 / 16) are exercised."""
    half = 8  # head_dim 16 / 2
    return save_tiny_model("phi3", tmp_path_factory.mktemp("tiny-phi3-longrope"), pad_token_id=0,
                           original_max_position_embeddings=16, rope_scaling={
                               "type": "longrope",
                               "short_factor": [1.0 + 0.1 * i for i in range(half)],
                               "long_factor": [2.0 + 0.5 * i for i in range(half)]})


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory):
    return save_tiny_model("mixtral", tmp_path_factory.mktemp("tiny-mixtral"),
                           num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory):
    # 4 experts of 32 columns (top 2, not renormalized) beside a shared expert of 96
    return save_tiny_model("qwen2_moe", tmp_path_factory.mktemp("tiny-qwen2-moe"),
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=96)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    # 4 experts of 48 columns, top 2 renormalized; head_dim 32 as in the dense Qwen3 fixture
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"), head_dim=32,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                           norm_topk_prob=True)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    return save_tiny_model("mistral", tmp_path_factory.mktemp("tiny-mistral"))


# Gemma: a window of 8 keys, so prompts of 9+ tokens reach past it; layer 0 sliding, layer
# 1 global; head_dim 16 against query_pre_attn_scalar 256 (the attention scale is not
# 1/sqrt(head_dim)). Gemma 2 soft-caps scores and logits; Gemma 3 norms q/k heads, rotates
# its sliding layer with a base of its own and its global one with linear scaling.


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory):
    return save_tiny_model("gemma2", tmp_path_factory.mktemp("tiny-gemma2"), head_dim=16,
                           sliding_window=GEMMA_WINDOW, tie_word_embeddings=True,
                           pad_token_id=0)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    return save_tiny_model("gemma3", tmp_path_factory.mktemp("tiny-gemma3"), head_dim=16,
                           sliding_window=GEMMA_WINDOW, tie_word_embeddings=True,
                           pad_token_id=0,
                           layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={
                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                  "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10_000.0}})


# ---- memory: engines must not outlive the tests that built them ------------------------------
# Each engine holds its weights and a KV pool (1 GiB by default on CPU), and this one process
# builds dozens. Two things kept finished ones alive, so the process grew to ~19 GB:
#  * workers built in-process (tests of decode/prefill workers) call freeze_startup_heap(), i.e.
#    gc.freeze(): every object alive then, later garbage included, is out of the collector's
#    reach for good, and engines sit in reference cycles (engine loop <-> its owner's bound
#    methods), so they were never freed;
#  * FastAPI keeps an lru_cache (4096 entries) of every endpoint function it has classified:
#    our HTTP routes are closures over their backend, so every HTTP front door's engine stayed.
# After each test (once pytest has dropped its fixture values): drop FastAPI's caches (they only
# classify callables, and refill), and when a fixture wider than one test was torn down, a test
# module ended or the heap was frozen: unfreeze, collect, and hand freed heap back to the OS
# (glibc keeps ~240 MB of a default-model engine's heap otherwise). ~100 collections a run.
_wide_fixture_finalized = False


def pytest_fixture_post_finalizer(fixturedef, request):
    global _wide_fixture_finalized
    if fixturedef.scope != "function":
        _wide_fixture_finalized = True


def _clear_fastapi_caches() -> None:
    models = sys.modules.get("fastapi.dependencies.models")
    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached",
                 "_is_coroutine_callable_cached"):
        cache_clear = getattr(getattr(models, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_mb() -> tuple[int, int]:
    """This process's resident set now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) // 1024
    return fields["VmRSS"], fields["VmHWM"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _wide_fixture_finalized
    yield  # the test ran and was torn down, and pytest dropped its fixture values
    _clear_fastapi_caches()
    last_of_module = nextitem is None or nextitem.path != item.path
    released = _wide_fixture_finalized or last_of_module or gc.get_freeze_count() > 0
    if released:
        _wide_fixture_finalized = False
        gc.unfreeze()
        gc.collect()
        _malloc_trim()
    # Opt-in: PDCLUSTER_TEST_RSS_LOG=path appends "test id, RSS MiB, peak RSS MiB" per test.
    log_path = os.environ.get("PDCLUSTER_TEST_RSS_LOG")
    if log_path:
        rss, hwm = _rss_mb()
        with open(log_path, "a") as f:
            f.write(f"{item.nodeid}\t{rss}\t{hwm}\t{'released' if released else ''}\n")


# ---- the shared local Ray (tests/helpers/shared_ray.py) ----------------------------------------
# Up only while modules that ask for it (``shared_ray_loop``) run: any other module may start a
# Ray of its own (a benchmark, `Cluster.start`, a placement test), so it is stopped first.
_modules_sharing_ray: dict[Path, bool] = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_asked(request):
    from tests.helpers.shared_ray import shared_ray_up, stop_shared_ray

    if shared_ray_up() and not _modules_sharing_ray.get(request.path, False):
        stop_shared_ray()


def pytest_collection_finish(session):
    for item in session.items:
        shares = "shared_ray_loop" in getattr(item, "fixturenames", ())
        _modules_sharing_ray[item.path] = _modules_sharing_ray.get(item.path, False) or shares


def pytest_sessionfinish(session):
    from tests.helpers.shared_ray import stop_shared_ray

    stop_shared_ray()


# ---- order: what two xdist workers are handed, module by module -------------------------------
# `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: xdist hands out whole modules in
# the collection's order (its default reorder, by number of tests, scattered the front-door
# package's modules over the run, and every return to the package started its two backends
# again: 10-30 s each). Here, after pytest's own reordering: the integration modules first, the
# front-door package as one block among them (one worker runs it whole: below), the
# unit modules last (many small modules: the two workers finish close together), the GPU tests
# (which skip without CUDA) at the very end. Order inside a module is pytest's.
def _module_rank(path: Path) -> int:
    parts = path.relative_to(Path(__file__).parent).parts
    if parts[0] == "integration":
        return 0 if parts[1] == "frontdoor" else 1
    return {"unit": 2, "gpu": 3}.get(parts[0], 2)


# Among the other integration modules, those on the shared Ray (``shared_ray_loop``) come
# first: a module between two of them that does not ask for it stops it, and the next one
# starts it again (~2 s up, ~1.3 s down; the alphabetical order held 8 runs of sharing modules,
# more once two workers split them).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    first_seen: dict[Path, int] = {}
    shares: dict[Path, bool] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)
        shares[item.path] = (shares.get(item.path, False)
                             or "shared_ray_loop" in getattr(item, "fixturenames", ()))
    items.sort(key=lambda it: (_module_rank(it.path), not shares[it.path], first_seen[it.path]))


# ---- whole packages to one worker ---------------------------------------------------------------
# `--dist loadfile` hands out one module at a time, so the front-door packages' modules went to
# both workers and each worker started the package's backends (a default-model engine and a 1+1
# Ray cluster; fp32 ones for frontdoor_fp32/): 5-20 s each, more under the suite's load. Each of
# these packages is one unit instead, run by one worker in the collection's order above
# (multinode/: one three-node Ray for its modules).
_WHOLE_PACKAGES = ("tests/integration/frontdoor/", "tests/integration/frontdoor_fp32/",
                   "tests/integration/multinode/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for any other mode
    from xdist.scheduler import LoadFileScheduling

    class WholePackages(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((p for p in _WHOLE_PACKAGES if path.startswith(p)), path)

    return WholePackages(config, log)
