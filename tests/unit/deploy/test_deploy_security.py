"""The Kubernetes manifests' secure defaults, for every overlay: every pod non-root with a
read-only root filesystem, no privilege escalation, no capabilities and RuntimeDefault
seccomp, writable paths only on emptyDirs, the router's API keys and TLS material from
read-only Secret mounts, Redis behind a password from a Secret that reaches the router only
through $(VAR) expansion, the dashboard on loopback, and placeholder Secrets that cannot pass
for real ones. Each check has a twin test that feeds it a deliberately weakened copy of the
rendered objects and expects it to object. Rendering and validation helpers:
test_deploy_manifests.py.
"""

from __future__ import annotations

import base64
import copy
import os

import pytest
import yaml

from tests.helpers.k8s_manifests import (
    HTTP_PORT,
    K8S_DIR,
    K8S_VERSION,
    OVERLAYS,
    _kuberay_validator,
    by_kind,
    kustomize,
    ray_container,
    redis_pod_labels,
    render,
)
from tests.helpers.k8s_security_checks import (
    API_KEYS_SECRET,
    COMPONENTS_DIR,
    PLACEHOLDER_MARK,
    REDIS_SECRET,
    TLS_SECRET,
    _secret_ref,
    containers,
    dashboard_violations,
    egress_rules,
    expected_writable_paths,
    head_of,
    placeholder_violations,
    pod_templates,
    redis_container,
    redis_password_violations,
    requirepass_source,
    restricted_violations,
    router_secret_violations,
    secret_file,
    secret_values,
    volume_named,
    writable_path_violations,
    writable_paths,
)


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
    validator = _kuberay_validator("RayCluster", "v1")
    errors = list(validator.iter_errors(by_kind(objs, "RayCluster")[0]))
    assert not errors, errors[:3]


def test_tensor_parallel_component_gives_decode_pods_a_gpu_per_rank(tmp_path):
    """components/tensor-parallel on the gpu overlay: the router starts decode workers with
    --decode-tp 2, each decode pod has two GPUs for its worker's two ranks, prefill pods keep
    one, and everything still validates strictly."""
    import kubernetes_validate

    kdir = tmp_path / "with-tp"
    kdir.mkdir()
    (kdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S_DIR / "overlays" / "gpu", kdir)],
        "components": [os.path.relpath(COMPONENTS_DIR / "tensor-parallel", kdir)],
    }))
    objs = kustomize(kdir)
    template, head = head_of(objs)
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["PDCLUSTER_DECODE_TP"] == "2"
    assert '--decode-tp "${PDCLUSTER_DECODE_TP:-1}"' in head["args"][0]
    (cluster,) = by_kind(objs, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    gpus = {name: str(g["template"]["spec"]["containers"][0]["resources"]["limits"]
                      ["nvidia.com/gpu"]) for name, g in groups.items()}
    assert gpus == {"prefill": "1", "decode": "2"}
    for g in groups.values():
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"},
                   "template": g["template"]}
        kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
    errors = list(_kuberay_validator("RayCluster", "v1").iter_errors(cluster))
    assert not errors, errors[:3]


def test_autoscaling_component_turns_on_both_autoscalers_with_matching_bounds(tmp_path):
    """components/autoscaling on the gpu overlay: KubeRay's in-tree autoscaler is on (its
    sidecar hardened like every container), only the head pod gets a service-account token
    (the sidecar patches the RayCluster), the router runs with --autoscale through
    $PDCLUSTER_SERVE_ARGS, whose bounds equal the worker groups' min/maxReplicas and parse
    as `pdcluster serve` flags; everything still validates strictly."""
    import shlex

    import kubernetes_validate

    from router.cli.main import build_parser
    from router.cli.serve_config import serve_config_from_args

    kdir = tmp_path / "with-autoscaling"
    kdir.mkdir()
    (kdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S_DIR / "overlays" / "gpu", kdir)],
        "components": [os.path.relpath(COMPONENTS_DIR / "autoscaling", kdir)],
    }))
    objs = kustomize(kdir)
    template, head = head_of(objs)
    (cluster,) = by_kind(objs, "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    sidecar = spec["autoscalerOptions"]["securityContext"]
    assert sidecar["runAsNonRoot"] and sidecar["readOnlyRootFilesystem"]
    assert sidecar["capabilities"]["drop"] == ["ALL"]
    assert not sidecar["allowPrivilegeEscalation"]
    assert template["spec"]["automountServiceAccountToken"] is True
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert all(g["template"]["spec"]["automountServiceAccountToken"] is False
               for g in groups.values())
    assert "${PDCLUSTER_SERVE_ARGS:-}" in head["args"][0]
    env = {e["name"]: e.get("value") for e in head["env"]}
    flags = shlex.split(env["PDCLUSTER_SERVE_ARGS"])
    workers = ["--prefill-workers", env["PDCLUSTER_PREFILL_WORKERS"],
               "--decode-workers", env["PDCLUSTER_DECODE_WORKERS"]]
    policy = serve_config_from_args(build_parser().parse_args(
        ["serve", *workers, *flags])).autoscale_config().policy
    for role in ("prefill", "decode"):
        assert policy.bounds(role) == (groups[role]["minReplicas"], groups[role]["maxReplicas"])
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "head"},
               "template": template}
    kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
    errors = list(_kuberay_validator("RayCluster", "v1").iter_errors(cluster))
    assert not errors, errors[:3]
