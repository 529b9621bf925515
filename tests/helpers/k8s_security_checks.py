"""The checks behind tests/unit/deploy/test_deploy_security.py: each is a function of the rendered
Kubernetes objects returning what it objects to (an empty list: nothing), so that a twin
test can hand it a deliberately weakened copy and expect an objection.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import shlex

from tests.helpers.k8s_manifests import (
    K8S_DIR,
    _selects,
    by_kind,
    ray_container,
)

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
