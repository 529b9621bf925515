"""Names of the custom Ray resources that place prefill and decode workers on their nodes.

Prefill is compute-bound and decode is memory-bound, so a cluster gives each kind its own
node pool (deploy/ray/cluster.yaml, deploy/k8s/, deploy/ray/local_multinode.sh). A node
advertises how many workers of a kind it can host as a custom resource, and each worker
actor asks for one unit of it (plus ``num_gpus=1`` on GPU nodes), so Ray puts prefill
workers only on prefill nodes and decode workers only on decode nodes. The deployment files
spell these same strings; tests/unit/test_ray_launcher.py keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_RESOURCE = "prefill_slot"
"""Custom resource a prefill worker actor requests one unit of (``resources={...: 1}``)."""

DECODE_RESOURCE = "decode_slot"
"""Custom resource a decode worker actor requests one unit of (``resources={...: 1}``)."""


class PlacementError(RuntimeError):
    """The Ray cluster cannot host the workers asked for; the message names what is missing."""


@dataclass(frozen=True)
class RoleNeed:
    """What the workers of one role ask Ray for, each."""

    role: str  # "prefill" | "decode" | "colocated"
    count: int
    resource: str  # PREFILL_RESOURCE or DECODE_RESOURCE
    num_cpus: float
    num_gpus: int = 0


def check_placement(nodes: list[dict], needs: list[RoleNeed]) -> bool:
    """Fail fast, before spawning, when no node can host a role's workers.

    ``nodes`` is ``ray.nodes()``. Returns whether role resources are in use (False: the
    cluster defines neither, and workers go wherever CPUs are free). Raises PlacementError
    naming the missing resource and listing the nodes, e.g. "no node offers decode_slot".
    This is a capacity check per role, not Ray's bin packing: a shape it passes can still
    leave a worker pending, which the start-up deadline then reports.
    """
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise PlacementError("the Ray cluster has no live node")
    defined = {r for n in alive for r in (PREFILL_RESOURCE, DECODE_RESOURCE)
               if n["Resources"].get(r, 0) > 0}
    for need in needs:
        if need.count == 0:
            continue
        pool = [n for n in alive if n["Resources"].get(need.resource, 0) > 0] if defined else alive
        if not pool:
            raise PlacementError(f"no node offers {need.resource} (needed by {need.count} "
                                 f"{need.role} workers); nodes: {_describe(alive)}")
        fits = sum(_fits(n["Resources"], need, bool(defined)) for n in pool)
        if fits < need.count:
            what = f"{need.resource}, " if defined else ""
            gpus = f", {need.num_gpus} GPU" if need.num_gpus else ""
            raise PlacementError(
                f"{need.count} {need.role} workers (each {what}{need.num_cpus:g} CPU{gpus}) "
                f"do not fit: room for {fits}; nodes: {_describe(alive)}")
    return bool(defined)


def _fits(res: dict, need: RoleNeed, by_resource: bool) -> int:
    n = int(res.get("CPU", 0) // need.num_cpus) if need.num_cpus else need.count
    if by_resource:
        n = min(n, int(res.get(need.resource, 0)))
    if need.num_gpus:
        n = min(n, int(res.get("GPU", 0) // need.num_gpus))
    return n


def _describe(nodes: list[dict]) -> str:
    keep = ("CPU", "GPU", PREFILL_RESOURCE, DECODE_RESOURCE)
    return "; ".join(
        f"{n.get('NodeManagerAddress', '?')} "
        + "{" + ", ".join(f"{k}: {n['Resources'][k]:g}" for k in keep if k in n["Resources"]) + "}"
        for n in nodes)
