"""Where workers may run: the custom Ray resources that place prefill and decode workers on
their nodes, how the workers share the cluster's GPUs, and the start-up check that the
cluster can host them at all.

Prefill is compute-bound and decode is memory-bound, so a cluster gives each kind its own
node pool (deploy/ray/cluster.yaml, deploy/k8s/, deploy/ray/local_multinode.sh). A node
advertises how many workers of a kind it can host as a custom resource, and each worker
actor asks for one unit of it (plus its GPU share, ``plan_gpu_share``), so Ray puts prefill
workers only on prefill nodes and decode workers only on decode nodes. The deployment files
spell these same strings; tests/unit/router/cluster/test_ray_launcher.py keeps the two in step.
"""

from __future__ import annotations

import math
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
    num_gpus: float = 0.0  # 1 (a GPU of its own) or a fraction (GPUs shared: GpuShare)


@dataclass(frozen=True)
class GpuShare:
    """How every worker of a cluster uses GPUs (one decision for all of them)."""

    num_gpus: float  # each worker's Ray request: 0 (CPU), 1, or 1/workers_per_gpu
    workers_per_gpu: int = 1  # > 1: that many workers share each GPU

    @property
    def use_gpus(self) -> bool:
        return self.num_gpus > 0

    @property
    def whole_gpus(self) -> bool:
        """Every worker has a GPU of its own (what NCCL needs: one rank per device)."""
        return self.num_gpus >= 1

    def describe(self) -> str:
        if not self.use_gpus:
            return "CPU only"
        if self.whole_gpus:
            return "one GPU per worker"
        return f"{self.workers_per_gpu} workers per GPU, {self.num_gpus:g} GPU each"


# Ray keeps resource amounts to 4 decimals; a share rounded up could make n shares exceed 1.
_RAY_RESOURCE_STEP = 10_000


def worker_gpus(nodes: list[dict]) -> float:
    """GPUs on the live nodes that can host workers: those offering a role resource when the
    cluster defines any (a head node's GPU hosts none of them), else every live node's."""
    alive = [n for n in nodes if n.get("Alive")]
    hosts = [n for n in alive if n["Resources"].get(PREFILL_RESOURCE, 0) > 0
             or n["Resources"].get(DECODE_RESOURCE, 0) > 0] or alive
    return sum(n["Resources"].get("GPU", 0) for n in hosts)


def plan_gpu_share(nodes: list[dict], num_workers: int, use_gpus: bool | None) -> GpuShare:
    """How ``num_workers`` workers share the GPUs of ``nodes`` (``ray.nodes()``).

    ``use_gpus``: None uses GPUs when the worker nodes have any, False never, True requires
    them (PlacementError at once when they have none, instead of workers that never start).
    With at least one GPU per worker each asks for 1; with fewer, each asks for
    1/ceil(workers/GPUs) (1 GPU, 1P+1D: 0.5 each): a share that divides 1, so Ray can pack
    the shares of each GPU without a remainder no worker fits in.
    """
    gpus = int(worker_gpus(nodes))  # a fraction of a GPU advertised by a node hosts no engine
    if use_gpus is False or (use_gpus is None and gpus == 0):
        return GpuShare(0.0)
    if gpus == 0:
        raise PlacementError(
            f"GPUs are required (--device cuda) but the Ray cluster's worker nodes have none: "
            f"{_describe([n for n in nodes if n.get('Alive')]) or 'no live node'}; start Ray "
            f"where `nvidia-smi` sees a GPU, or serve with --device cpu")
    if gpus >= num_workers:
        return GpuShare(1.0)
    per_gpu = math.ceil(num_workers / gpus)
    return GpuShare(math.floor(_RAY_RESOURCE_STEP / per_gpu) / _RAY_RESOURCE_STEP, per_gpu)


def check_placement(nodes: list[dict], needs: list[RoleNeed]) -> bool:
    """Fail fast, before spawning, when no node can host a role's workers.

    ``nodes`` is ``ray.nodes()``. Returns whether role resources are in use (False: the
    cluster defines neither, and workers go wherever CPUs are free). Raises PlacementError
    naming the missing resource and listing the nodes, e.g. "no node offers decode_slot".
    GPU requests may be fractions (``GpuShare``); besides each role's own fit, the GPU
    shares of all roles together must fit the cluster's GPUs (both roles may draw on the
    same GPU). This is a capacity check, not Ray's bin packing: a shape it passes can still
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
            gpus = f", {need.num_gpus:g} GPU" if need.num_gpus else ""
            raise PlacementError(
                f"{need.count} {need.role} workers (each {what}{need.num_cpus:g} CPU{gpus}) "
                f"do not fit: room for {fits}; nodes: {_describe(alive)}")
    _check_gpu_total(alive, needs, bool(defined))
    return bool(defined)


def _check_gpu_total(alive: list[dict], needs: list[RoleNeed], by_resource: bool) -> None:
    gpu_needs = [n for n in needs if n.num_gpus and n.count]
    if not gpu_needs:
        return
    share = max(n.num_gpus for n in gpu_needs)
    hosts = [n for n in alive if not by_resource
             or any(n["Resources"].get(need.resource, 0) > 0 for need in gpu_needs)]
    room = sum(_gpu_slots(n["Resources"], share) for n in hosts)
    count = sum(n.count for n in gpu_needs)
    if room < count:
        raise PlacementError(
            f"{count} workers (each {share:g} GPU) do not fit the GPUs of the nodes that "
            f"can host them: room for {room}; nodes: {_describe(alive)}")


def _gpu_slots(res: dict, share: float) -> int:
    # The epsilon: float division gives 0.3 / 0.1 = 2.9999999999999996, which is 3 shares.
    return int(res.get("GPU", 0) / share + 1e-6)


def _fits(res: dict, need: RoleNeed, by_resource: bool) -> int:
    n = int(res.get("CPU", 0) // need.num_cpus) if need.num_cpus else need.count
    if by_resource:
        n = min(n, int(res.get(need.resource, 0)))
    if need.num_gpus:
        n = min(n, _gpu_slots(res, need.num_gpus))
    return n


def _describe(nodes: list[dict]) -> str:
    keep = ("CPU", "GPU", PREFILL_RESOURCE, DECODE_RESOURCE)
    return "; ".join(
        f"{n.get('NodeManagerAddress', '?')} "
        + "{" + ", ".join(f"{k}: {n['Resources'][k]:g}" for k in keep if k in n["Resources"]) + "}"
        for n in nodes)
