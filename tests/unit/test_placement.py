"""Start-up placement checks and KV address resolution: fail fast, naming what is missing."""

from __future__ import annotations

import pytest

from router.placement import PlacementError, RoleNeed, check_placement
from router.serve import ServeConfig
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
