"""Start-up placement checks and KV address resolution: fail fast, naming what is missing."""

from __future__ import annotations

import pytest

from router.cli.serve_config import ServeConfig
from router.cluster.placement import (
    GpuShare,
    PlacementError,
    RoleNeed,
    check_placement,
    plan_gpu_share,
)
from worker_protocol.runtime import KV_HOST_ENV, interface_ipv4, resolve_kv_host


def _node(ip: str, **resources) -> dict:
    return {"NodeManagerAddress": ip, "Alive": True, "Resources": {"CPU": 4.0, **resources}}


NEEDS = [RoleNeed("prefill", 2, "prefill_slot", 1.0), RoleNeed("decode", 2, "decode_slot", 1.0)]


def test_role_resources_in_use_and_enough():
    nodes = [_node("10.0.0.1", prefill_slot=2), _node("10.0.0.2", decode_slot=1),
             _node("10.0.0.3", decode_slot=1)]
    assert check_placement(nodes, NEEDS) is True


def test_a_missing_role_resource_is_named_with_the_nodes():
    nodes = [_node("10.0.0.1", prefill_slot=2), _node("10.0.0.2")]
    with pytest.raises(PlacementError) as e:
        check_placement(nodes, NEEDS)
    msg = str(e.value)
    assert msg.startswith("no node offers decode_slot (needed by 2 decode workers)")
    assert "10.0.0.1 {CPU: 4, prefill_slot: 2}" in msg and "10.0.0.2 {CPU: 4}" in msg


def test_too_few_slots_or_cpus_or_gpus():
    with pytest.raises(PlacementError, match="2 decode workers .* room for 1"):
        check_placement([_node("a", prefill_slot=2, decode_slot=1)], NEEDS)
    one_cpu = [{"NodeManagerAddress": "a", "Alive": True,
                "Resources": {"CPU": 1.0, "prefill_slot": 2, "decode_slot": 2}}]
    with pytest.raises(PlacementError, match="room for 1"):
        check_placement(one_cpu, NEEDS)
    gpu_needs = [RoleNeed("decode", 2, "decode_slot", 1.0, num_gpus=1)]
    with pytest.raises(PlacementError, match="1 GPU"):
        check_placement([_node("a", decode_slot=2, GPU=1.0)], gpu_needs)


def _one_node_cluster(gpus: float, num_prefill: int = 1, num_decode: int = 1) -> list[dict]:
    """What ray.nodes() says of the Ray a local `pdcluster serve` starts (with ``gpus`` GPUs:
    ``ray.init(num_gpus=1)`` declares one even on a CPU-only machine)."""
    res = {"prefill_slot": num_prefill, "decode_slot": num_decode}
    return [_node("127.0.0.1", **res, **({"GPU": gpus} if gpus else {}))]


def _needs(share: GpuShare, num_prefill: int = 1, num_decode: int = 1) -> list[RoleNeed]:
    return [RoleNeed("prefill", num_prefill, "prefill_slot", 1.0, share.num_gpus),
            RoleNeed("decode", num_decode, "decode_slot", 1.0, share.num_gpus)]


def test_one_gpu_is_shared_by_halves_between_a_prefill_and_a_decode_worker():
    nodes = _one_node_cluster(gpus=1)
    share = plan_gpu_share(nodes, num_workers=2, use_gpus=None)
    assert (share.num_gpus, share.workers_per_gpu, share.whole_gpus) == (0.5, 2, False)
    assert check_placement(nodes, _needs(share)) is True  # both halves fit the one GPU


def test_one_gpu_per_worker_when_there_are_enough():
    nodes = [_node("10.0.0.1", prefill_slot=1, GPU=1.0), _node("10.0.0.2", decode_slot=2, GPU=2.0)]
    share = plan_gpu_share(nodes, num_workers=3, use_gpus=None)
    assert share == GpuShare(1.0) and share.whole_gpus
    assert check_placement(nodes, _needs(share, 1, 2))


def test_shares_divide_a_gpu_so_ray_can_pack_them():
    # 2 GPUs, 3 workers: 2/3 each would leave the third worker no GPU with 2/3 free.
    share = plan_gpu_share(_one_node_cluster(gpus=2, num_decode=2), 3, None)
    assert (share.num_gpus, share.workers_per_gpu) == (0.5, 2)
    # 1 GPU, 3 workers: a third each, rounded down to Ray's 4 decimals so three fit.
    nodes = _one_node_cluster(gpus=1, num_decode=2)
    share = plan_gpu_share(nodes, 3, None)
    assert (share.num_gpus, share.workers_per_gpu) == (0.3333, 3)
    assert check_placement(nodes, _needs(share, 1, 2))


def test_gpus_off_or_absent_means_cpu_workers():
    assert plan_gpu_share(_one_node_cluster(gpus=0), 2, None) == GpuShare(0.0)
    assert not plan_gpu_share(_one_node_cluster(gpus=1), 2, use_gpus=False).use_gpus
    # A head node's GPU hosts no worker when the cluster places workers by role.
    head_gpu = [_node("10.0.0.1", GPU=1.0), _node("10.0.0.2", prefill_slot=1, decode_slot=1)]
    assert plan_gpu_share(head_gpu, 2, None) == GpuShare(0.0)


def test_required_gpus_on_a_cluster_without_any_fail_at_once_naming_the_nodes():
    with pytest.raises(PlacementError) as e:
        plan_gpu_share(_one_node_cluster(gpus=0), 2, use_gpus=True)
    msg = str(e.value)
    assert "GPUs are required" in msg and "have none" in msg and "--device cpu" in msg
    assert "127.0.0.1 {CPU: 4, prefill_slot: 1, decode_slot: 1}" in msg


def test_gpu_shortfalls_with_fractions_are_named():
    # Two roles each fit the one GPU alone, but not together.
    nodes = _one_node_cluster(gpus=1, num_prefill=2, num_decode=2)
    with pytest.raises(PlacementError, match=r"4 workers \(each 0.5 GPU\) do not fit .* room for 2"):
        check_placement(nodes, _needs(GpuShare(0.5, 2), 2, 2))
    # A role whose own nodes lack GPU room, its message saying the share.
    split = [_node("10.0.0.1", prefill_slot=2, GPU=1.0), _node("10.0.0.2", decode_slot=2)]
    with pytest.raises(PlacementError, match=r"2 decode workers .*0.5 GPU\) do not fit: room for 0"):
        check_placement(split, _needs(GpuShare(0.5, 2), 2, 2))


def test_no_role_resources_places_by_cpu_and_dead_nodes_do_not_count():
    assert check_placement([_node("a"), _node("b")], NEEDS) is False
    dead = dict(_node("b", decode_slot=2), Alive=False)
    with pytest.raises(PlacementError, match="no node offers decode_slot"):
        check_placement([_node("a", prefill_slot=2), dead], NEEDS)
    with pytest.raises(PlacementError, match="no live node"):
        check_placement([dead], NEEDS)


def test_kv_host_resolution_order(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a bare worker, outside Ray
    monkeypatch.delenv(KV_HOST_ENV, raising=False)
    assert resolve_kv_host().address == "127.0.0.1"  # not in Ray: loopback
    monkeypatch.setenv(KV_HOST_ENV, "10.9.8.7")
    assert resolve_kv_host() == resolve_kv_host(None, None)
    assert resolve_kv_host().address == "10.9.8.7" and resolve_kv_host().source == KV_HOST_ENV
    assert resolve_kv_host(kv_interface="lo").address == "127.0.0.1"  # the NIC beats the env
    assert resolve_kv_host("10.1.1.1", "lo").address == "10.1.1.1"  # explicit beats all
    assert resolve_kv_host(kv_interface="lo").is_loopback


def test_unknown_interface_is_a_clear_error():
    assert interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="'nosuch0' has no IPv4 address on this host.*lo"):
        interface_ipv4("nosuch0")


def test_serve_refuses_both_kv_flags():
    with pytest.raises(ValueError, match="--kv-host or --kv-interface"):
        ServeConfig(kv_host="10.0.0.1", kv_interface="eth1")
    cc = ServeConfig(kv_interface="eth1", startup_timeout_s=30).cluster_config()
    assert (cc.kv_interface, cc.kv_host, cc.startup_timeout_s) == ("eth1", None, 30)
