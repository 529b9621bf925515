"""Start or join Ray, spawn prefill and decode workers, and serve the backend contract over them.

``Cluster`` is the Python entry point (``router.cluster.ray_cluster.Cluster``) that ``pdcluster serve`` wraps:
``cluster = await Cluster.start(ClusterConfig(...))`` then ``cluster.generate(...)``. It owns
its workers (``router.cluster.launcher`` spawns them or re-attaches to a deployment's; ``shutdown``
ends them unless they are kept for the next router) and, if it started Ray itself, Ray too.
Placement: CPU workers ask for ``num_cpus``; with GPUs each asks for one, or a fraction of
one when there are fewer GPUs than workers (router.cluster.placement.plan_gpu_share; KV then moves
over gloo instead of NCCL); and each role asks for its custom resource (``prefill_slot`` /
``decode_slot``) when the cluster defines it, so separate prefill and decode node types each
get the right workers. Everything that cannot work fails start-up with a message naming it
(PlacementError before spawning, StartupError for a worker that cannot start) instead of
waiting for workers Ray will never place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from engine.args import EngineArgs
from engine.text.input_processor import InputProcessor
from engine.text.tokenizer import load_tokenizer
from engine.weights.resolve import load_model_config, resolve_model
from kv_transfer import KVLayout
from router.cluster.autoscale import Autoscaler
from router.cluster.cluster_config import ClusterConfig, check_kv_cache_dtypes, check_tp_layouts
from router.cluster.launcher import (
    JOIN_TIMEOUT_S,
    RAY_NAMESPACE,
    StartupError,
    WorkerLauncher,
    death_cause,
    join_ray,
)
from router.cluster.local_ray import start_local_ray
from router.cluster.placement import DECODE_RESOURCE, PREFILL_RESOURCE
from router.contract import (
    BackendStats,
    DrainStatus,
    GenerateInput,
    GenerationChunk,
    ModelInfo,
    WorkerStatus,
    as_invalid_request,
)
from router.control.adapters import AdapterBackend
from router.control.embeddings import EmbeddingBackend
from router.control.orchestrator import Orchestrator, OrchestratorConfig
from router.control.worker_health import is_restarting
from worker_protocol import WorkerInfo, WorkerLoad, control, liveness

log = logging.getLogger(__name__)


class Cluster(AdapterBackend, EmbeddingBackend):
    """A running cluster; implements ``router.contract.GenerationBackend``."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.launcher = WorkerLauncher(config, tag=f"{id(self):x}")
        self._started_ray = False  # we called ray.init (local start or join): we call ray.shutdown
        self.orchestrator: Orchestrator | None = None
        self.store = None
        self._info: ModelInfo | None = None
        self._refresh_task: asyncio.Task | None = None
        self._rejoining: dict[str, asyncio.Task] = {}  # worker id -> its rejoin after a restart
        self._placement = None  # what every worker shares (set at start; added workers too)
        self._model_path = ""
        self.autoscaler: Autoscaler | None = None
        self._progress: Callable[[str], None] = lambda step: None

    # ---- lifecycle ------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: ClusterConfig,
                    on_progress: Callable[[str], None] | None = None) -> Cluster:
        """Start (or join) Ray and every worker. ``on_progress(step)`` is called as each
        start-up step completes ("model", "ray", then one call per worker id)."""
        cluster = cls(config)
        cluster._progress = on_progress or (lambda step: None)
        try:
            await cluster._start()
        except BaseException:
            await cluster.shutdown(keep=set(cluster.launcher.attached))  # what it found stays
            raise
        return cluster

    async def _start(self) -> None:
        import ray

        from router.state.factory import make_store

        cfg = self.config
        if not ray.is_initialized():
            if cfg.ray_address:
                await join_ray(cfg.ray_address, min(JOIN_TIMEOUT_S, cfg.startup_timeout_s))
                # We connected, so we disconnect on shutdown (the cluster itself keeps running).
                self._started_ray = True
            else:
                # Room for as many workers as the autoscaler may run, not just the first ones.
                n = (cfg.max_workers("prefill") * cfg.prefill_engine.tensor_parallel_size
                     + cfg.max_workers("decode") * cfg.decode_engine.tensor_parallel_size)
                # Logical CPUs: workers are mostly waiting on memory, and one per core would
                # make a 2-core laptop unable to host a 1+1 cluster plus the router.
                start_local_ray(num_cpus=max(4, int(n * cfg.worker_num_cpus) + 1),
                                namespace=RAY_NAMESPACE, include_dashboard=False,
                                log_to_driver=False,
                                resources={PREFILL_RESOURCE: cfg.max_workers("prefill"),
                                           DECODE_RESOURCE: cfg.max_workers("decode")})
                self._started_ray = True
        self._progress("ray")
        # First, before loading anything: a cluster that cannot host the workers fails now.
        placement = self.launcher.plan_placement()
        self.store = make_store(cfg.redis_url, namespace=cfg.store_namespace,
                                require=cfg.require_redis)
        resolved = resolve_model(cfg.model, cache_dir=cfg.decode_engine.cache_dir)
        self._progress("model")
        # The KV dtype the workers will really use ("auto" is bfloat16 on GPU, float32 on
        # CPU): the layout every transfer is checked against must say the same.
        model_cfg = load_model_config(resolved.model_dir,
                                      dtype=placement.kv_dtype(cfg.decode_engine.dtype),
                                      model_id=resolved.model_id)
        model_path = str(resolved.model_dir)  # workers load the converted dir: no re-conversion
        self._placement, self._model_path = placement, model_path
        tokenizer = load_tokenizer(resolved.model_dir)
        layout = KVLayout.from_model_config(model_cfg, cfg.decode_engine.kv_cache_dtype)
        check_tp_layouts(model_cfg, cfg)  # before any worker loads: names both sides
        check_kv_cache_dtypes(cfg)

        specs: list[tuple[str, str, EngineArgs]] = []
        if cfg.mode == "disaggregated":
            specs += [(f"prefill-{i}", "prefill", cfg.prefill_engine)
                      for i in range(cfg.num_prefill_workers)]
        role = "decode" if cfg.mode == "disaggregated" else "colocated"
        specs += [(f"decode-{i}", role, cfg.decode_engine) for i in range(cfg.num_decode_workers)]
        wanted = [self.launcher.worker_config(wid, r, dataclasses.replace(args, model=model_path),
                                      placement) for wid, r, args in specs]
        handles = [self.launcher.attach(w) or self.launcher.spawn(w, placement) for w in wanted]
        infos: list[WorkerInfo] = await asyncio.gather(
            *[self._ready(wid, h) for (wid, _, _), h in zip(specs, handles, strict=True)])

        decode_infos = [i for i in infos if i.role != "prefill"]
        max_len = min(i.max_model_len for i in infos)
        max_kv_tokens = min(i.num_kv_blocks * i.block_size for i in decode_infos)
        self._info = ModelInfo(model_cfg.model_id, max_len, model_cfg.vocab_size,
                               model_cfg.eos_token_ids, cfg.mode,
                               tokenizer.tool_call_format() if tokenizer is not None else None)
        orch = Orchestrator(
            OrchestratorConfig(model_cfg.model_id, cfg.mode, transfer_timeout_s=cfg.transfer_timeout_s,
                               capacity_wait_s=cfg.capacity_wait_s, call_timeout_s=cfg.call_timeout_s,
                               token_timeout_s=cfg.token_timeout_s,
                               enable_lora=cfg.decode_engine.enable_lora,
                               tenant_weights=dict(cfg.tenant_weights),
                               migration_limit=cfg.migration_limit,
                               migration_prefill=cfg.migration_prefill,
                               orphan_after_s=cfg.orphan_after_s,
                               suspect_after_s=cfg.suspect_after_s,
                               max_inflight_requests=cfg.max_inflight_requests,
                               prefix_hash_seed=cfg.decode_engine.prefix_hash_seed,
                               routing=cfg.routing, tracing=cfg.tracing),
            tokenizer, InputProcessor(tokenizer, model_cfg.vocab_size, max_len, max_kv_tokens),
            layout, self.store, self._kv_event_source())
        for info, handle in zip(infos, handles, strict=True):
            orch.add_worker(info, handle)
            self.store.register_worker(_worker_record(info, model_cfg.model_id), ttl_s=15.0)
        orch.drains.retire = self._retire
        self.orchestrator = orch
        for name, path in cfg.lora_modules:  # --lora-modules: every worker holds them first
            await orch.adapters.load(name, path)
        self._refresh_task = asyncio.ensure_future(self._refresh_loads())
        if cfg.autoscale is not None:
            self.autoscaler = Autoscaler(self, cfg.autoscale)
            self.autoscaler.start()
        for i in infos:  # one line per worker: operators (and the placement test) read these
            log.info("worker %s role=%s node=%s host=%s kv=%s transport=%s pid=%d",
                     i.worker_id, i.role, i.node_id, i.node_ip, i.kv_host, i.kv_transport, i.pid)

    def _kv_event_source(self):
        """With Redis, routers read the workers' KV events from its streams (the workers
        publish there too); without it they pull them from the workers (router.routing.kv_sync)."""
        url = self.config.kv_events_redis_url
        if url is None:
            return None
        from worker_protocol.kv_stream import RedisKVEventSource

        return RedisKVEventSource(url, self.config.store_namespace)


    async def _ready(self, worker_id: str, handle) -> WorkerInfo:
        """The worker's WorkerInfo once it is up. A constructor that raised (no CUDA, a bad
        setting, out of memory) kills the actor, and Ray fails this call at once (it does
        not restart an actor whose constructor raised): StartupError with the cause."""
        from ray.exceptions import RayActorError

        try:
            info = await asyncio.wait_for(handle.info.remote(), self.config.startup_timeout_s)
        except TimeoutError:
            raise StartupError(
                f"worker {worker_id} was not up within {self.config.startup_timeout_s:g} s "
                f"(still loading its model, or no node can take it: check `ray status`)"
            ) from None
        except RayActorError as e:
            raise StartupError(f"worker {worker_id} failed to start: {death_cause(e)}") from e
        self.launcher.starting.pop(worker_id, None)
        self._progress(info.worker_id)
        return info

    async def _refresh_loads(self) -> None:
        """Keep the router's view of each worker's KV use fresh; heartbeat the registry.

        Each worker's report is a call of its own with a deadline, started each round unless
        its last one still waits: a worker whose host went silent (or a SIGSTOPped one) is
        marked unreachable (no new requests) and holds back no other worker's report, nor the
        KV events refreshed each round. A report from a new incarnation (Ray restarted the
        process) makes the worker rejoin first."""
        timeout = min(2.0, self.config.call_timeout_s)
        polls: dict[str, asyncio.Future] = {}
        try:
            while True:
                orch = self.orchestrator
                # Dead ones too while restarts are on: a call to an actor gone for good fails
                # at once, and one that Ray brought back answers with its new incarnation.
                slots = [s for s in (*orch.prefill.values(), *orch.decode.values())
                         if s.view.alive or (self.config.worker_restarts and not s.view.drained)]
                for slot in slots:
                    wid = slot.info.worker_id
                    if wid not in polls or polls[wid].done():
                        polls[wid] = asyncio.ensure_future(self._load_report(slot, timeout))
                orch.health.check_silent(orch.decode.values())
                orch.kv_sync.kick([s for s in slots if s.view.alive and s.view.reachable])
                await asyncio.sleep(0.25)
        finally:
            for task in polls.values():
                task.cancel()
            await asyncio.gather(*polls.values(), return_exceptions=True)

    async def _load_report(self, slot, timeout: float) -> None:
        orch = self.orchestrator
        try:
            load = await asyncio.wait_for(liveness(slot.handle.load).remote(orch.router_id),
                                          timeout)
        except TimeoutError:
            orch.health.unreachable(slot, f"no load report within {timeout:g} s")
            return
        except Exception as e:
            orch.health.on_error(slot, e)
            return
        if load.incarnation != slot.info.incarnation:
            self._start_rejoin(slot)
            return
        orch.health.reachable(slot)
        slot.view.load = load
        orch.usage.note(load)
        self._heartbeat(slot, load)

    def _start_rejoin(self, slot) -> None:
        wid = slot.info.worker_id
        if wid not in self._rejoining:
            self._rejoining[wid] = asyncio.ensure_future(self._rejoin(slot))

    async def _rejoin(self, slot) -> None:
        """Re-read a restarted worker's WorkerInfo (new pid, new KV port), hand it to the
        orchestrator and register it again. A failure leaves it for the next report."""
        wid = slot.info.worker_id
        try:
            info = await asyncio.wait_for(control(slot.handle.info).remote(),
                                          self.config.call_timeout_s)
            self.orchestrator.rejoin(slot, info)
            self._register_again(info)
        except Exception as e:
            log.warning("worker %s restarted but could not rejoin yet: %r", wid, e)
        finally:
            self._rejoining.pop(wid, None)

    def _register_again(self, info: WorkerInfo) -> None:
        """The registry record of a restarted worker: its new KV address; its prefix entries
        are dropped (the new process caches nothing yet)."""
        from router.state.store import StoreError

        try:
            self.store.deregister_worker(info.worker_id)
            self.store.register_worker(_worker_record(info, self._info.model_id), ttl_s=15.0)
        except StoreError as e:
            log.warning("cluster store unavailable, %s not re-registered: %s", info.worker_id, e)

    def _heartbeat(self, slot, load: WorkerLoad) -> None:
        """Registry heartbeat with the worker's load; a store outage must not stop serving."""
        from router.state.store import StoreError, UnknownWorkerError

        report = dataclasses.replace(load, reported_at=time.time())
        try:
            try:
                self.store.heartbeat(slot.info.worker_id, ttl_s=15.0, load=report)
            except UnknownWorkerError:  # our record lapsed (e.g. a long pause): register again
                self.store.register_worker(_worker_record(slot.info, self._info.model_id), ttl_s=15.0)
        except StoreError as e:
            log.warning("cluster store unavailable, registry not updated: %s", e)

    async def shutdown(self, keep: set | None = None) -> None:
        """Stop serving, and the workers too, except the handles in ``keep`` (default: all
        of them when ``keep_workers``, for the next router of the deployment to re-attach)."""
        import ray

        if keep is None:
            keep_all = self.launcher.detached and self.config.keep_workers
            keep = set(self.launcher.actors) if keep_all else set()
        if self.autoscaler is not None:
            await self.autoscaler.close()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        for t in list(self._rejoining.values()):
            t.cancel()
        if self.orchestrator is not None:
            await self.orchestrator.close()
            if self.store is not None and not keep:  # other routers must stop using them
                for wid in (*self.orchestrator.prefill, *self.orchestrator.decode):
                    with contextlib.suppress(Exception):
                        self.store.deregister_worker(wid)
        for a in self.launcher.actors:
            if a in keep:
                continue
            with contextlib.suppress(Exception):
                await asyncio.wait_for(a.shutdown.remote(), timeout=5)
            ray.kill(a, no_restart=True)
        self.launcher.actors.clear()
        if self.store is not None:
            self.store.close()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # ---- GenerationBackend ----------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize(self, prompt: str | list[dict], tools: list[dict] | None = None,
                 add_special_tokens: bool | None = None, chat_template_kwargs: dict | None = None
                 ) -> list[int]:
        return as_invalid_request(self.orchestrator.inputs.encode, prompt, tools,
                                  add_special_tokens, chat_template_kwargs).token_ids

    def detokenize(self, token_ids: list[int]) -> str:
        return as_invalid_request(self.orchestrator.inputs.decode, token_ids)

    def generate(self, inp: GenerateInput) -> AsyncIterator[GenerationChunk]:
        return self.orchestrator.streams.keep(inp, self.orchestrator.generate(inp))

    def resume(self, request_id: str, from_index: int = 0) -> AsyncIterator[GenerationChunk]:
        return self.orchestrator.streams.resume(request_id, from_index)

    async def stream_kind(self, request_id: str) -> str | None:
        return await self.orchestrator.streams.kind(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.orchestrator.abort(request_id)

    async def stats(self) -> BackendStats:
        orch = self.orchestrator
        slots = [s for s in (*orch.prefill.values(), *orch.decode.values()) if s.view.alive]
        # Each report within call_timeout_s: a hung worker must not hang a /metrics scrape.
        loads = await asyncio.gather(*[asyncio.wait_for(liveness(s.handle.load).remote(),
                                                        self.config.call_timeout_s)
                                       for s in slots], return_exceptions=True)
        workers = [lo for lo in loads if not isinstance(lo, BaseException)]
        for lo in workers:
            orch.usage.note(lo)
        return BackendStats(workers, orch.kv_transfer_bytes_total, dict(orch.migrations),
                            self.store.up, dict(orch.usage.prefix_hit_tokens),
                            orch.usage.prefill_computed_tokens, dict(orch.usage.decode_steps),
                            dict(orch.usage.mixed_steps), orch.pulls.pulled_tokens,
                            orch.pulls.recomputed_tokens,
                            self.autoscaler.desired() if self.autoscaler else {},
                            dict(self.autoscaler.decisions) if self.autoscaler else {},
                            orch.phases.snapshot(), orch.phases.transfer_snapshot(),
                            {a.name: (a.requests, a.tokens) for a in orch.adapters.adapters()},
                            dataclasses.astuple(orch.outcomes))

    async def drain_worker(self, worker_id: str, migrate_after_s: float | None = None,
                           wait: bool = False) -> DrainStatus:
        drains = self.orchestrator.drains
        status = drains.start(worker_id, migrate_after_s)
        return await drains.wait(worker_id) if wait else status

    async def add_worker(self, role: str, ready_timeout_s: float | None = None) -> WorkerInfo:
        """Start one more worker of ``role`` ("prefill" | "decode": colocated in colocated
        mode) like the first ones, wait until it is up (at most ``ready_timeout_s``, default
        the start-up timeout) and route to it. A worker Ray cannot place (no node with a free
        slot: Ray's autoscaler may be asking for one) or that fails to start raises
        StartupError, and nothing of it is left behind."""
        import ray

        cfg, orch = self.config, self.orchestrator
        if role not in ("prefill", "decode") or (role == "prefill"
                                                  and cfg.mode != "disaggregated"):
            raise ValueError(f"no {role!r} workers in a {cfg.mode} cluster")
        taken = {*orch.prefill, *orch.decode, *self.launcher.starting}
        wid = next(f"{role}-{i}" for i in itertools.count() if f"{role}-{i}" not in taken)
        engine = cfg.prefill_engine if role == "prefill" else cfg.decode_engine
        wrole = role if cfg.mode == "disaggregated" else "colocated"
        wcfg = self.launcher.worker_config(
            wid, wrole, dataclasses.replace(engine, model=self._model_path), self._placement)
        handle = self.launcher.spawn(wcfg, self._placement)
        timeout = cfg.startup_timeout_s if ready_timeout_s is None else ready_timeout_s
        try:
            info = await asyncio.wait_for(self._ready(wid, handle), timeout)
        except BaseException as e:
            self.launcher.starting.pop(wid, None)
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
            if handle in self.launcher.actors:
                self.launcher.actors.remove(handle)
            if isinstance(e, TimeoutError):
                raise StartupError(f"worker {wid} was not up within {timeout:g} s (no node "
                                   f"with a free {role} slot, or still loading)") from None
            raise
        orch.add_worker(info, handle)
        with contextlib.suppress(Exception):  # a store outage must not lose the worker
            self.store.register_worker(_worker_record(info, self._info.model_id), ttl_s=15.0)
        log.warning("added worker %s (%s) on %s, pid %d", wid, wrole, info.node_ip, info.pid)
        return info

    async def _retire(self, slot) -> None:
        """End a drained worker: no longer registered, routed to or restarted; its process
        shut down (its KV pool and second tier freed, its tier files removed)."""
        import ray

        wid = slot.info.worker_id
        slot.view.alive, slot.view.drained = False, True
        self.orchestrator.kv_index.invalidate(wid)
        with contextlib.suppress(Exception):
            self.store.deregister_worker(wid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(slot.handle.shutdown.remote(), timeout=5)
        ray.kill(slot.handle, no_restart=True)
        if slot.handle in self.launcher.actors:
            self.launcher.actors.remove(slot.handle)

    async def worker_loads(self) -> list:
        """Every live worker's full load report (reserved blocks included); tests use this.
        A worker Ray is restarting, or whose process died for good, has no report (it holds
        nothing); the latter is declared dead here if nothing did before (a worker whose
        lifeline closed is only unreachable until Ray's table says which)."""
        import ray.exceptions

        orch = self.orchestrator
        slots = [s for s in (*orch.prefill.values(), *orch.decode.values()) if s.view.alive]
        loads = await asyncio.gather(*[asyncio.wait_for(liveness(s.handle.load).remote(),
                                                        self.config.call_timeout_s)
                                       for s in slots], return_exceptions=True)
        for slot, lo in zip(slots, loads, strict=True):
            if isinstance(lo, ray.exceptions.ActorDiedError):
                orch.health.dead(slot, repr(lo))
            elif isinstance(lo, BaseException) and not is_restarting(lo):
                raise lo
        return [lo for lo in loads if not isinstance(lo, BaseException)]

    async def cluster_status(self) -> list[WorkerStatus]:
        """Every worker this cluster started, with its state and last load report."""
        orch = self.orchestrator
        now = time.monotonic()
        out = [WorkerStatus(wid, role, "", 0, "starting") for wid, role in self.launcher.starting.items()]
        for slot in (*orch.prefill.values(), *orch.decode.values()):
            i, v, lo = slot.info, slot.view, slot.view.load
            state = ("drained" if v.drained else "dead" if not v.alive
                     else "draining" if v.draining
                     else "unreachable" if not v.routable(now) else "ready")
            addr = i.kv_address
            out.append(WorkerStatus(
                i.worker_id, i.role, i.node_ip, i.pid, state,
                lo.kv_blocks_used if lo else 0, i.num_kv_blocks,
                lo.requests_running if lo else 0, lo.requests_waiting if lo else 0,
                lo.kv_transfer_bytes if lo else 0, f"{addr.host}:{addr.port}" if addr else "",
                v.restarts, i.tp_size, i.rank_pids, lo.engine_threads if lo else 0,
                lo.cpu_stolen if lo else 0.0, i.layout.kv_cache_dtype,
                i.layout.bytes_per_token * i.block_size))
        return out

    def worker_handle(self, worker_id: str):
        """The Ray actor handle of one worker (tests, operators' scripts)."""
        orch = self.orchestrator
        return (orch.prefill.get(worker_id) or orch.decode[worker_id]).handle

    async def worker_ready(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is up, reachable and takes new requests now."""
        return any(w.id == worker_id and w.state == "ready" for w in await self.cluster_status())


def _worker_record(info: WorkerInfo, model_id: str):
    from router.state.store import WorkerRecord

    addr = info.kv_address
    return WorkerRecord(info.worker_id, info.role, info.node_id, addr.host if addr else "",
                        addr.port if addr else 0, info.num_kv_blocks, info.block_size, model_id,
                        time.time())
