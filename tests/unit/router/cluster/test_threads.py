"""The default split of a machine's cores among workers (router.cluster.threads), and the flags over it."""

import pytest

from router.cluster.threads import ROUTER_CORE_FROM, plan_threads


def test_small_machines_give_every_core_to_the_engines():
    # 2 cores, colocated: both threads to the one worker, which keeps OpenMP's default
    # (spinning between regions: sleeping would cost every region of its step).
    plan = plan_threads(2, 0, 1, environ={})
    assert (plan.decode_threads, plan.prefill_env) == (2, {})
    assert plan.summary == "2 cores: 1 colocated x 2 threads"
    # 2 cores, 1 prefill + 1 decode: decode's share is one thread, so prefill (bursts) may
    # use both cores; sharing them with decode, its threads sleep when idle.
    plan = plan_threads(2, 1, 1, environ={})
    assert (plan.prefill_threads, plan.decode_threads) == (2, 1)
    assert plan.prefill_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert plan.summary == ("2 cores: 1 prefill x 2 + 1 decode x 1 threads; "
                            "prefill threads sleep when idle (cores shared)")
    # 4 cores: decode gets a team of 2, which prefill bursts would stall: an even split.
    plan = plan_threads(4, 1, 1, environ={})
    assert (plan.prefill_threads, plan.decode_threads) == (2, 2)
    # Every worker single-threaded (2 cores, 1 prefill + 2 decode): nothing to set.
    plan = plan_threads(2, 1, 2, environ={}, prefill_threads=1)
    assert (plan.prefill_threads, plan.decode_threads, plan.prefill_env) == (1, 1, {})


def test_larger_machines_keep_a_core_for_the_router():
    plan = plan_threads(ROUTER_CORE_FROM, 1, 1, environ={})
    assert (plan.prefill_threads, plan.decode_threads) == (3, 3)
    assert plan.prefill_env == {}  # 3 + 3 + the router's = 7 of 8 cores: nothing shared
    assert plan.summary.endswith("1 core left to the router")
    plan = plan_threads(32, 0, 2, environ={})
    assert plan.decode_threads == 15 and plan.prefill_env == {}
    plan = plan_threads(16, 2, 5, environ={})  # more workers than the split can feed well
    assert (plan.prefill_threads, plan.decode_threads) == (2, 2)


def test_flags_win_and_the_operators_environment_is_kept():
    plan = plan_threads(16, 1, 1, threads_per_worker=4, decode_threads=12, environ={})
    assert (plan.prefill_threads, plan.decode_threads) == (4, 12)
    # 4 + 12 + 1 > 16: shared, so the prefill worker's threads sleep when idle ...
    assert plan.prefill_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "1 core left" not in plan.summary
    # ... unless the operator chose a policy: theirs reaches the workers unchanged.
    assert plan_threads(16, 1, 1, threads_per_worker=4, decode_threads=12,
                        environ={"OMP_WAIT_POLICY": "ACTIVE"}).prefill_env == {}
    with pytest.raises(ValueError):
        plan_threads(0, 1, 1)


def test_serve_passes_the_plan_to_the_cluster():
    from router.cli.serve_config import ServeConfig

    cfg = ServeConfig(mode="colocated", decode_workers=1, threads_per_worker=2)
    assert cfg.cluster_config().decode_engine.num_threads == 2
    cfg = ServeConfig(mode="disaggregated")  # this machine's default split
    plan, cc = cfg.thread_plan(), cfg.cluster_config()
    assert cc.prefill_engine.num_threads == plan.prefill_threads
    assert cc.decode_engine.num_threads == plan.decode_threads
    assert cc.prefill_env == plan.prefill_env
