"""A discrete-event model of a pdcluster cluster, driven by a measured engine profile.

What it models, after the real request path (docs/architecture.md, "The request lifecycle"; ``router/control/orchestrator.py``):

- **router**: a request reserves KV on the decode worker with the most free KV that fits its
  prompt + output (waiting at the router while none does, as ``capacity_wait``), and goes to
  the prefill worker with the fewest prompt tokens queued (``--routing load``);
- **prefill worker**: FCFS steps of up to ``max_num_batched_tokens`` prompt tokens (a longer
  prompt is chunked over steps); a step of ``n`` tokens takes ``profile.prefill_s(n)``;
- **KV transfer**: layer-wise, overlapped with the compute; what is left exposed after the
  step is ``max(0, transfer - step)`` at the profile's loopback bandwidth, plus
  ``overhead_s`` for the router's calls (reserve, commit, first-token delivery); the first
  token reaches the client then, and the KV is on the decode worker;
- **decode worker**: continuous batching of at most ``max_num_seqs`` sequences; a step of
  ``b`` sequences at mean context ``c`` takes ``profile.decode_step_s(b, c)`` and gives each
  one token; a finished request frees its KV;
- **cores** (CPU hosts): workers share ``cores`` cores, ``threads`` each, with the router,
  which takes ``router_cpu_s_per_token`` (a served profile's) for each token it streams;
  while ``k`` steps run and the decode steps among them produce ``r`` tokens/s, each runs
  ``max(1, k * threads / (cores - r * router_cpu_s_per_token))`` times slower (a processor
  shared evenly), or, where a prefill and a decode step run at once, the served profile's
  measured ``prefill_beside_decode`` / ``decode_beside_prefill`` times
  ``max(1, k * threads / cores)`` if that is more. Steps are re-rated whenever one starts
  or ends (a prefill that a decode batch joins halfway is slowed for its second half only).
  On GPUs each worker has its own device: no sharing;
- **a busy decode worker** answers the router's reserve and commit between its steps: a
  first token whose decode worker is stepping comes ``busy_overhead_steps`` (a served
  profile's measurement) of that worker's current step later.

Colocated mode: each worker runs its requests' prompts as chunks inside its decode steps,
the prompt budget first (a step's time is the sum of its prefill and decode parts).

Not modelled: prefix-cache hits (every prompt is computed: plan with a workload whose
prompts do not repeat, or read the result as the no-reuse case), preemption (a request only
starts where its whole output fits), the front door's own CPU.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from engine.tuning.profile import EngineProfile
from router.planning.workload import TraceRequest

__all__ = ["ClusterShape", "SimResult", "simulate"]


@dataclass(frozen=True)
class ClusterShape:
    """What is planned: the split, the decode batch cap, each worker's KV pool (tokens)."""

    num_prefill: int
    num_decode: int
    max_num_seqs: int = 32
    kv_tokens: int = 1 << 20  # per decode worker
    mode: str = "disaggregated"  # or "colocated" (num_prefill is ignored)
    max_num_batched_tokens: int = 2048
    cores: float = math.inf  # CPU cores the workers share (inf: a device each)
    threads: int = 1  # cores each worker's step uses
    # Router calls between the prefill's end and the first token (a served profile's
    # measured overhead_s replaces it).
    overhead_s: float = 0.03

    @property
    def workers(self) -> int:
        return self.num_decode + (self.num_prefill if self.mode == "disaggregated" else 0)


@dataclass
class _Req:
    spec: TraceRequest
    idx: int
    remaining_prompt: int = 0
    first_token_s: float | None = None
    done_s: float | None = None
    generated: int = 0  # tokens so far (the first one from the prefill)
    rejected: bool = False
    decode: _Worker | None = None  # where its KV is reserved

    @property
    def context(self) -> int:
        return self.spec.prompt_tokens + self.generated


@dataclass
class SimResult:
    """Per-request times and the summary a plan ranks by."""

    shape: ClusterShape
    ttft_s: list[float] = field(default_factory=list)  # one per completed request
    tpot_s: list[float] = field(default_factory=list)  # one per request with > 1 token
    completed: int = 0
    rejected: int = 0  # prompt + output larger than a decode worker's KV pool
    span_s: float = 0.0  # first arrival to last arrival
    makespan_s: float = 0.0  # first arrival to last completion
    within_slo: int = 0

    def goodput_rps(self) -> float:
        return self.within_slo / max(self.span_s, 1e-9)

    def goodput_per_worker(self) -> float:
        return self.goodput_rps() / self.shape.workers


@dataclass
class _Worker:
    wid: int
    role: str
    queue: deque = field(default_factory=deque)  # prefill: prompts; decode: KV arrived
    running: list = field(default_factory=list)  # decode: sequences in the batch
    kv_used: int = 0
    queued_tokens: int = 0
    busy: bool = False


@dataclass(eq=False)
class _Step:
    """One worker's step in progress: ``work`` seconds of it alone are left at ``since``."""

    worker: _Worker
    kind: str  # "prefill" or "decode" (a colocated step with decoding sequences: decode)
    done: str  # _on_<done>(t, step) at its end
    payload: object
    solo: float  # its whole time alone
    work: float
    since: float
    started: float
    slowdown: float = 1.0
    version: int = 0


class _Sim:
    def __init__(self, profile: EngineProfile, shape: ClusterShape,
                 requests: list[TraceRequest]) -> None:
        self.p, self.s = profile, shape
        # A served profile measured the first token's fixed cost; a bare one did not.
        self.overhead_s = (shape.overhead_s if profile.overhead_s is None
                           else profile.overhead_s)
        self.reqs = [_Req(r, i, r.prompt_tokens) for i, r in enumerate(requests)]
        self.events: list = []
        self._seq = itertools.count()
        colocated = shape.mode == "colocated"
        self.prefill = [] if colocated else [_Worker(i, "prefill")
                                             for i in range(shape.num_prefill)]
        self.decode = [_Worker(i, "decode") for i in range(shape.num_decode)]
        self.waiting_for_kv: deque = deque()  # at the router: no decode worker had room
        self.steps: dict[int, _Step] = {}  # id(worker) -> its step now (re-rated together)
        self.token_rates: dict[int, float] = {}  # decode worker -> tokens/s of its step now

    def push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def slowdown(self, step: _Step) -> float:
        """How many times slower than alone ``step`` runs beside the steps running now."""
        if math.isinf(self.s.cores):
            return 1.0
        k = len(self.steps)
        # The router streams the tokens the decode steps running now produce, on the same
        # cores (a served profile's measured CPU per token; at most 3/4 of them).
        router = self.p.router_cpu_s_per_token * sum(self.token_rates.values())
        cores = self.s.cores - min(router, 0.75 * self.s.cores)
        shared = max(1.0, k * self.s.threads / cores)
        # A prefill beside a decode step (and the reverse) was measured while serving: the
        # router, Ray and the KV threads of both workers were in it.
        other = {o.kind for o in self.steps.values() if o is not step}
        beside = 1.0
        if step.kind == "prefill" and "decode" in other:
            beside = self.p.prefill_beside_decode
        elif step.kind == "decode" and "prefill" in other:
            beside = self.p.decode_beside_prefill
        return max(shared, beside * max(1.0, k * self.s.threads / self.s.cores))

    def _rerate(self, t: float) -> None:
        """Bring every running step's work to ``t`` and re-time its end at today's rates."""
        for st in self.steps.values():
            st.work = max(0.0, st.work - (t - st.since) / st.slowdown)
            st.since = t
        for st in self.steps.values():
            st.slowdown = self.slowdown(st)
            st.version += 1
            self.push(t + st.work * st.slowdown, "step_end", (st, st.version))

    def _on_step_end(self, t: float, payload) -> None:
        st, version = payload
        if version != st.version:
            return  # re-rated since: a later event ends it
        del self.steps[id(st.worker)]
        st.worker.busy = False
        if st.done == "decode_done":  # its tokens stream no more (before the re-rate)
            self.token_rates.pop(st.worker.wid, None)
        self._rerate(t)
        getattr(self, f"_on_{st.done}")(t, st)

    def run(self) -> list[_Req]:
        for r in self.reqs:
            self.push(r.spec.arrival_s, "arrive", r)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(t, payload)
        return self.reqs

    # ---- router ------------------------------------------------------------------------------
    def _on_arrive(self, t: float, r: _Req) -> None:
        need = r.spec.prompt_tokens + r.spec.output_tokens
        if need > self.s.kv_tokens:
            r.rejected = True
            return
        self.waiting_for_kv.append(r)
        self._route(t)

    def _route(self, t: float) -> None:
        while self.waiting_for_kv:
            r = self.waiting_for_kv[0]
            need = r.spec.prompt_tokens + r.spec.output_tokens
            fits = [w for w in self.decode if self.s.kv_tokens - w.kv_used >= need]
            if not fits:
                return  # FCFS at the router, as requests wait for capacity in order
            self.waiting_for_kv.popleft()
            d = max(fits, key=lambda w: (self.s.kv_tokens - w.kv_used, -w.wid))
            d.kv_used += need
            r.decode = d
            if self.s.mode == "colocated":
                d.queue.append(r)
                self._start_decode(t, d)
            else:
                pw = min(self.prefill, key=lambda w: (w.queued_tokens, w.wid))
                pw.queue.append(r)
                pw.queued_tokens += r.remaining_prompt
                self._start_prefill(t, pw)

    # ---- prefill worker ----------------------------------------------------------------------
    def _start_prefill(self, t: float, w: _Worker) -> None:
        if w.busy or not w.queue:
            return
        chunks = self._chunks(w.queue)
        dt = self.p.prefill_s(sum(n for _, n in chunks))
        self._begin_step(t, w, dt, "prefill", "prefill_done", chunks)

    def _on_prefill_done(self, t: float, st: _Step) -> None:
        w, chunks, dt = st.worker, st.payload, t - st.started
        for r, n in chunks:
            r.remaining_prompt -= n
            w.queued_tokens -= n
            if r.remaining_prompt == 0:
                w.queue.remove(r)
                transfer = (r.spec.prompt_tokens * self.p.kv_bytes_per_token
                            / max(self.p.loopback_bytes_s, 1.0))
                # Its reserve and commit wait for its decode worker's step boundaries.
                busy = self.steps.get(id(r.decode))
                wait = 0.0 if busy is None else (self.p.busy_overhead_steps * busy.solo
                                                 * busy.slowdown)
                self.push(t + max(0.0, transfer - dt) + self.overhead_s + wait, "first_token", r)
        self._start_prefill(t, w)

    def _on_first_token(self, t: float, r: _Req) -> None:
        r.first_token_s, r.generated = t, 1
        if r.spec.output_tokens == 1:
            self._finish(t, r)
            return
        r.decode.queue.append(r)
        self._start_decode(t, r.decode)

    def _begin_step(self, t: float, w: _Worker, solo_s: float, kind: str, done: str,
                    payload) -> None:
        """Start ``w``'s step of ``solo_s`` seconds alone; ``_on_<done>(t, step)`` at its end."""
        w.busy = True
        self.steps[id(w)] = _Step(w, kind, done, payload, solo_s, solo_s, since=t, started=t)
        self._rerate(t)

    def _chunks(self, prompts) -> list[tuple[_Req, int]]:
        """This step's prompt chunks, FCFS within the token budget (the last one cut)."""
        budget, chunks = self.s.max_num_batched_tokens, []
        for r in prompts:
            if budget <= 0:
                break
            n = min(r.remaining_prompt, budget)
            chunks.append((r, n))
            budget -= n
        return chunks

    # ---- decode worker -----------------------------------------------------------------------
    def _start_decode(self, t: float, w: _Worker) -> None:
        if w.busy:
            return
        colocated = self.s.mode == "colocated"
        while w.queue and len(w.running) < self.s.max_num_seqs:
            w.running.append(w.queue.popleft())
        # Colocated: prompts not done yet are computed in this step, within the budget.
        prefill = [r for r in w.running if colocated and r.remaining_prompt > 0]
        decoding = [r for r in w.running if r not in prefill]
        if not w.running:
            return
        dt, chunks = 0.0, self._chunks(prefill)
        if chunks:
            dt += self.p.prefill_s(sum(n for _, n in chunks))
        if decoding:
            ctx = sum(r.context for r in decoding) / len(decoding)
            dt += self.p.decode_step_s(len(decoding), ctx)
        if not chunks and not decoding:
            return
        if decoding:
            self.token_rates[w.wid] = len(decoding) / dt
        self._begin_step(t, w, dt, "decode" if decoding else "prefill", "decode_done",
                         (chunks, decoding))

    def _on_decode_done(self, t: float, st: _Step) -> None:
        w, (chunks, decoding) = st.worker, st.payload
        for r in decoding:
            r.generated += 1
            if r.generated >= r.spec.output_tokens:
                w.running.remove(r)
                self._finish(t, r)
        for r, n in chunks:
            r.remaining_prompt -= n
            if r.remaining_prompt == 0:  # its first token, from this step
                r.first_token_s, r.generated = t + self.overhead_s, 1
                if r.spec.output_tokens == 1:
                    w.running.remove(r)
                    self._finish(t, r)
        self._start_decode(t, w)
        self._route(t)

    def _finish(self, t: float, r: _Req) -> None:
        r.done_s = t
        r.decode.kv_used -= r.spec.prompt_tokens + r.spec.output_tokens
        self._route(t)


def simulate(profile: EngineProfile, shape: ClusterShape, requests: list[TraceRequest],
             slo_ttft_s: float, slo_tpot_s: float) -> SimResult:
    """Run ``requests`` through a cluster of ``shape`` and summarize against the SLO."""
    if shape.mode == "disaggregated" and shape.num_prefill < 1 or shape.num_decode < 1:
        raise ValueError("a cluster needs a decode worker (and, disaggregated, a prefill one)")
    reqs = _Sim(profile, shape, requests).run()
    res = SimResult(shape)
    if not reqs:
        return res
    t0 = reqs[0].spec.arrival_s
    res.span_s = max(r.spec.arrival_s for r in reqs) - t0
    for r in reqs:
        if r.rejected:
            res.rejected += 1
            continue
        res.completed += 1
        ttft = r.first_token_s - r.spec.arrival_s
        res.ttft_s.append(ttft)
        tpot = None
        if r.spec.output_tokens > 1:
            tpot = (r.done_s - r.first_token_s) / (r.spec.output_tokens - 1)
            res.tpot_s.append(tpot)
        res.makespan_s = max(res.makespan_s, r.done_s - t0)
        if ttft <= slo_ttft_s and (tpot is None or tpot <= slo_tpot_s):
            res.within_slo += 1
    return res
