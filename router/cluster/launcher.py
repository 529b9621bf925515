"""Where a cluster's workers come from: joining Ray, building each worker's configuration,
spawning its Ray actor, or re-attaching to one a previous router of the deployment left.

Joining an existing Ray cluster (``ClusterConfig.ray_address``), workers are detached actors
named ``{name}-{worker id}``: they outlive the router's death, and the next router of the
deployment re-attaches to those that run the configuration it wants (others are replaced).
Otherwise (the router started Ray itself) their names are private to the router and they
end with it. ``stop_deployment`` ends a deployment's detached workers (``pdcluster stop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import threading
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.config import resolve_dtype
from router.cluster.placement import (
    DECODE_RESOURCE,
    PREFILL_RESOURCE,
    GpuShare,
    PlacementError,
    RoleNeed,
    check_placement,
    plan_gpu_share,
    worker_gpus,
)
from worker_protocol import (
    CONTROL_GROUP,
    CONTROL_GROUP_THREADS,
    LIVENESS_GROUP,
    LIVENESS_GROUP_THREADS,
    WorkerConfig,
    control,
)

__all__ = ["JOIN_TIMEOUT_S", "RAY_NAMESPACE", "Placement", "StartupError", "WorkerLauncher",
           "death_cause", "join_ray", "stop_deployment"]

log = logging.getLogger(__name__)

RAY_NAMESPACE = "pdcluster"
JOIN_TIMEOUT_S = 60.0


class StartupError(RuntimeError):
    """The cluster could not start; the message names the worker or resource at fault."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def death_cause(error: BaseException) -> str:
    """The line of a dead actor's error (a RayActorError) that says why: for a constructor
    that raised, its exception ("ValueError: device 'cuda' requested but CUDA is not
    available"), not the coloured traceback Ray wraps it in."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(error)).splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


@dataclass(frozen=True)
class Placement:
    """What every spawned worker shares (decided once, before spawning)."""

    gpus: GpuShare  # each worker's GPU request (router.cluster.placement.plan_gpu_share)
    by_role: bool  # workers ask for their role's resource (the cluster defines them)
    kv_host: str | None
    kv_interface: str | None

    @property
    def use_gpus(self) -> bool:
        return self.gpus.use_gpus

    def kv_dtype(self, dtype: str) -> str:
        """The dtype workers built with engine ``dtype`` give their KV cache ("auto":
        bfloat16 on GPU workers, float32 on CPU ones); the router's KVLayout must say it."""
        return resolve_dtype(dtype, "cuda" if self.use_gpus else "cpu")

    @property
    def kv_transport(self) -> str:
        """The KV transport of every worker: "nccl" only when each has a GPU of its own (NCCL
        cannot put two ranks of a group on one device); "gloo" for CPU workers and workers
        sharing a GPU (the sender stages a GPU engine's layers through host memory)."""
        return "nccl" if self.gpus.whole_gpus else "gloo"


class WorkerLauncher:
    """Builds, spawns and re-attaches the workers of one cluster (``config`` is its
    ``ClusterConfig``); ``actors`` holds every handle it produced, ``attached`` those found
    running, ``starting`` the ids not up yet (worker id -> role)."""

    def __init__(self, config, tag: str) -> None:
        self.config = config
        self.tag = tag  # makes actor names private to one router when not detached
        self.actors: list = []
        self.attached: list = []
        self.starting: dict[str, str] = {}

    def plan_placement(self) -> Placement:
        """Check, before spawning anything, that the Ray cluster can host every worker, and
        decide what every worker shares: its GPU share and KV transport, role resources or
        not, KV address. Raises PlacementError naming what is missing."""
        import ray

        cfg = self.config
        nodes = ray.nodes()
        num_prefill = cfg.num_prefill_workers if cfg.mode == "disaggregated" else 0
        tp_p, tp_d = cfg.prefill_engine.tensor_parallel_size, cfg.decode_engine.tensor_parallel_size
        # Every tensor-parallel rank is a process with a GPU of its own (on GPUs), all of a
        # worker's on its node: the worker asks Ray for them together.
        gpus = plan_gpu_share(nodes, num_prefill * tp_p + cfg.num_decode_workers * tp_d,
                              cfg.use_gpus)
        if gpus.use_gpus and not gpus.whole_gpus and max(tp_p, tp_d) > 1:
            raise PlacementError(
                f"tensor parallelism needs a GPU per rank: {num_prefill} prefill x {tp_p} + "
                f"{cfg.num_decode_workers} decode x {tp_d} ranks, the worker nodes have "
                f"{worker_gpus(nodes):g} GPUs")
        by_role = check_placement(nodes, [
            RoleNeed("prefill", num_prefill, PREFILL_RESOURCE, cfg.worker_num_cpus * tp_p,
                     gpus.num_gpus * tp_p),
            RoleNeed("decode" if cfg.mode == "disaggregated" else "colocated",
                     cfg.num_decode_workers, DECODE_RESOURCE, cfg.worker_num_cpus * tp_d,
                     gpus.num_gpus * tp_d)])
        if not by_role:
            log.warning("the Ray cluster defines neither %r nor %r: workers may land on any node",
                        PREFILL_RESOURCE, DECODE_RESOURCE)
        hosts = {n["NodeManagerAddress"] for n in nodes if n["Alive"]}
        kv_host = cfg.kv_host
        if kv_host is None and cfg.kv_interface is None and len(hosts) == 1:
            kv_host = "127.0.0.1"  # every peer shares this host: KV never leaves loopback
        placement = Placement(gpus, by_role, kv_host, cfg.kv_interface)
        if gpus.use_gpus:
            log.info("GPUs: %s; KV over %s%s", gpus.describe(), placement.kv_transport,
                     "" if gpus.whole_gpus else " through host memory; each worker's "
                     f"gpu_memory_utilization is 1/{gpus.workers_per_gpu} of the flag's")
        else:
            log.info("GPUs: none used; workers run on CPU, KV over gloo")
        return placement

    def worker_config(self, worker_id: str, role: str, engine_args: EngineArgs,
                       placement: Placement) -> WorkerConfig:
        cfg = self.config
        wcfg = WorkerConfig(worker_id, role, engine_args, kv_host=placement.kv_host,
                            kv_interface=placement.kv_interface,
                            transfer_timeout_s=cfg.transfer_timeout_s, lease_s=cfg.lease_s,
                            stream_layers=cfg.stream_layers,
                            kv_events_redis_url=cfg.kv_events_redis_url,
                            kv_events_namespace=cfg.store_namespace, tracing=cfg.tracing)
        if worker_id in cfg.worker_overrides:
            wcfg = dataclasses.replace(wcfg, **cfg.worker_overrides[worker_id])
        args = wcfg.engine_args
        if placement.use_gpus:
            # Ray shows the actor its GPU (CUDA_VISIBLE_DEVICES): cuda:0 there. Workers
            # sharing a GPU split gpu_memory_utilization, so their pools together stay under
            # it (each counts only its own allocations: engine.executor.device.kv_pool_bytes).
            share = args.gpu_memory_utilization / placement.gpus.workers_per_gpu
            args = dataclasses.replace(args, device="cuda", gpu_memory_utilization=share)
        else:  # Ray gave it no GPU: an "auto" engine must not take one anyway
            args = dataclasses.replace(args, device="cpu")
        return dataclasses.replace(wcfg, engine_args=args, kv_transport=placement.kv_transport)

    def spawn(self, wcfg: WorkerConfig, placement: Placement):
        import ray

        from decode_workers.worker import DecodeWorker
        from prefill_workers.worker import PrefillWorker

        cfg = self.config
        worker_id, role = wcfg.worker_id, wcfg.role
        cls = PrefillWorker if role == "prefill" else DecodeWorker
        resource = PREFILL_RESOURCE if role == "prefill" else DECODE_RESOURCE
        # A tensor-parallel worker's ranks are its own child processes: it asks for their
        # CPUs and GPUs (one each) together, so Ray places them on one node.
        tp = wcfg.engine_args.tensor_parallel_size
        # Control calls (abort, ...) and liveness calls (ping, load) get threads of their
        # own: see CONTROL_GROUP, LIVENESS_GROUP.
        actor = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_GROUP_THREADS,
                                               LIVENESS_GROUP: LIVENESS_GROUP_THREADS}
                           )(cls).options(
            name=self.actor_name(worker_id), namespace=RAY_NAMESPACE,
            lifetime="detached" if self.detached else None,
            num_cpus=cfg.worker_num_cpus * tp, num_gpus=placement.gpus.num_gpus * tp,
            resources={resource: 1} if placement.by_role else {},
            # Ray re-runs the constructor in a new process; the router notices the new
            # incarnation in the next load report and rejoins it (_rejoin). No task is retried
            # by Ray: the router decides what a lost call costs the request.
            max_concurrency=64, max_restarts=cfg.worker_restarts, max_task_retries=0,
            # Read by the OpenMP runtime when torch loads it: only a fresh process takes it.
            **({"runtime_env": {"env_vars": dict(cfg.prefill_env)}}
               if role == "prefill" and cfg.prefill_env else {}),
        ).remote(wcfg)
        self.actors.append(actor)
        self.starting[worker_id] = role
        return actor

    @property
    def detached(self) -> bool:
        """Workers outlive this router (it joined an existing Ray cluster)."""
        return self.config.ray_address is not None

    def actor_name(self, worker_id: str) -> str:
        if self.detached:
            return f"{self.config.name}-{worker_id}"
        return f"{worker_id}-{self.tag}"  # private to this router: tests share one Ray

    def attach(self, wanted: WorkerConfig):
        """The handle of this deployment's live worker ``wanted.worker_id`` (left by a router
        that died, or stopped with keep_workers), or None. One built with another config is
        stopped (the new config wins: it is spawned anew); one of another role is an operator
        error (two deployments sharing a name)."""
        import ray

        worker_id, role = wanted.worker_id, wanted.role
        if not self.detached:
            return None
        try:
            handle = ray.get_actor(self.actor_name(worker_id), namespace=RAY_NAMESPACE)
        except ValueError:  # no such actor: spawn it
            return None
        try:
            info = ray.get(control(handle.info).remote(), timeout=self.config.call_timeout_s)
        except Exception as e:  # dying or dead: replace it
            log.warning("worker %s exists but does not answer (%r); starting a new one",
                        worker_id, e)
            ray.kill(handle, no_restart=True)
            return None
        if info.role != role:
            raise StartupError(f"deployment {self.config.name!r} already has a {info.role} "
                               f"worker {worker_id!r}; this router wants a {role} one (use "
                               f"another --name, or `pdcluster stop` the old deployment)")
        theirs = ray.get(control(handle.worker_config).remote(), timeout=self.config.call_timeout_s)
        if theirs != wanted:
            log.warning("worker %s runs another configuration than this router's; replacing "
                        "it", worker_id)
            with contextlib.suppress(Exception):
                ray.get(handle.shutdown.remote(), timeout=5)
            ray.kill(handle, no_restart=True)
            return None
        log.info("re-attached to worker %s (pid %d): no model load", worker_id, info.pid)
        self.actors.append(handle)
        self.attached.append(handle)
        self.starting[worker_id] = role
        return handle


async def stop_deployment(ray_address: str, name: str, timeout_s: float = 60.0) -> list[str]:
    """Kill every worker of deployment ``name`` on the Ray cluster at ``ray_address`` (the
    detached workers routers re-attach to); returns their actor names."""
    import ray

    await join_ray(ray_address, timeout_s)
    try:
        prefix = f"{name}-"
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == RAY_NAMESPACE and a["name"].startswith(prefix)
                       and a["name"][len(prefix):].split("-")[0] in ("prefill", "decode"))
        for n in names:
            handle = ray.get_actor(n, namespace=RAY_NAMESPACE)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.shutdown.remote(), timeout=5)
            ray.kill(handle, no_restart=True)
        return names
    finally:
        ray.shutdown()


async def join_ray(address: str, timeout_s: float) -> None:
    """``ray.init(address=...)`` with a deadline. Ray itself retries an unreachable GCS for
    minutes, silently; the call runs on a daemon thread, so giving up does not wait for it."""
    import ray

    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(None) if error is None else done.set_exception(error)

    def join() -> None:
        error = None
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        except BaseException as e:  # handed to the waiting coroutine
            error = e
        loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=join, name="ray-join", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except TimeoutError:
        raise StartupError(f"could not join the Ray cluster at {address} within {timeout_s:g} s "
                           f"(is its head running, and is its GCS port reachable from here?)"
                           ) from None
