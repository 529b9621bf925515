"""A background thread that drives an LLMEngine: commands in, one batch of outputs out per step.

Owns the engine from the moment it starts: every engine call (add, abort, step, KV import)
happens on this thread, between steps, so the engine itself never needs a lock. Callers post
commands; the loop hands each step's outputs to ``sink`` as one list (one message per step,
never one per token). Used by the decode worker, the colocated worker and ``AsyncEngine``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from engine.contract import RequestOutput
from engine.runtime.compute_thread import ComputeThread
from engine.runtime.llm_engine import LLMEngine

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.002
# An engine idle this long with warm-up work left (``LLMEngine.idle_warmup``: a worker's lazy
# tokenizer) does it then: not during start-up, when a restarted worker's CPU would come out
# of the survivors taking over its streams, and not during a step.
_WARM_AFTER_IDLE_S = 2.0

Sink = Callable[[list[RequestOutput]], None]


@dataclass
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: Future


class EngineLoop:
    """Runs ``engine.step()`` whenever there is work; sleeps on the command queue otherwise."""

    def __init__(self, engine: LLMEngine, sink: Sink, name: str = "engine-loop",
                 on_crash: Callable[[BaseException], None] | None = None,
                 after_work: Callable[[LLMEngine], None] | None = None,
                 compute: ComputeThread | None = None) -> None:
        """``on_crash(error)`` runs on the loop thread if a step raises (the engine's state is
        then unknown: a worker exits so Ray reports it dead; the in-process engine fails
        every open request). Bad *requests* never get here: they fail alone inside a step.
        ``after_work(engine)`` runs on the loop thread after every step and every run of
        commands (a worker publishes the step's KV events there); it must not raise.
        ``compute``: the thread the engine was built on, to loop on (engine.runtime.compute_thread
        says why); None: a new one named ``name``. The loop owns it from here and closes it."""
        self.engine = engine
        # When the loop last came round between two steps (monotonic): a step that never
        # ends leaves it behind (a worker tells a busy engine from a stuck one by it).
        self.turned_at = time.monotonic()
        self._sink = sink
        self._on_crash = on_crash
        self._after_work = after_work
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        # Orders "check stopped + enqueue" in call() against setting stopped, so a command is
        # either rejected at once or enqueued before the final _fail_pending drain (never lost).
        self._stop_lock = threading.Lock()
        self.error: BaseException | None = None
        self._compute = compute or ComputeThread(name)
        self._done = self._compute.submit(self._run)
        self._compute.close()  # once the loop returns

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps; the future holds its result.

        Outputs that ``fn`` returns as a list of RequestOutput are NOT sent to the sink; use
        ``call_and_emit`` for that.
        """
        fut: Future = Future()
        with self._stop_lock:
            if self._stopped.is_set():
                fut.set_exception(RuntimeError("engine loop is stopped"))
                return fut
            self._commands.put(_Command(fn, fut))
        return fut

    def call_and_emit(self, fn: Callable[[LLMEngine], list[RequestOutput] | RequestOutput | None]
                      ) -> Future:
        """Like ``call``, and any outputs ``fn`` returns go to the sink (e.g. abort results)."""

        def run(engine: LLMEngine):
            outs = fn(engine)
            if isinstance(outs, RequestOutput):
                outs = [outs]
            if outs:
                self._sink(outs)
            return outs

        return self.call(run)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; pending commands fail. Idempotent."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        self._commands.put(None)
        wait_futures([self._done], timeout_s)

    def wait_ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the loop to end (stopped, or crashed); whether it has."""
        return not wait_futures([self._done], timeout_s).not_done

    @property
    def alive(self) -> bool:
        return not self._done.done()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self.turned_at = time.monotonic()
                # Nothing schedulable (all requests await remote KV, or a dynamic batch is still
                # filling): wait briefly for commands instead of spinning on empty steps.
                if not self.engine.has_unfinished_requests:
                    warm = self.engine.idle_warmup
                    if warm is None:
                        self._drain(timeout_s=None)
                    elif not self._drain(timeout_s=_WARM_AFTER_IDLE_S):
                        warm()  # a command arriving meanwhile waits for it, once
                elif self.engine.last_step_idle:
                    self._drain(timeout_s=_IDLE_POLL_S)
                else:
                    self._drain(timeout_s=0)
                if self._stopped.is_set():
                    break
                if self.engine.has_unfinished_requests:
                    outs = self.engine.step()
                    if outs:
                        self._sink(outs)
                if self._after_work is not None:
                    self._after_work(self.engine)
        except BaseException as e:  # surface to callers instead of dying silently
            log.exception("engine loop crashed")
            self.error = e
            if self._on_crash is not None:
                self._on_crash(e)
        finally:
            with self._stop_lock:
                self._stopped.set()
            self._fail_pending()

    def _drain(self, timeout_s: float | None) -> bool:
        """Run the queued commands (waiting up to ``timeout_s`` for the first); whether any
        came."""
        try:
            cmd = (self._commands.get_nowait() if timeout_s == 0
                   else self._commands.get(timeout=timeout_s))
        except queue.Empty:
            return False
        # stop() may come while a command runs: the ones queued behind it fail, not run.
        while cmd is not None and not self._stopped.is_set():
            self._execute(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
        if cmd is not None:
            self._fail(cmd)
        self._stopped.set()
        return True

    def _execute(self, cmd: _Command) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            cmd.future.set_result(cmd.fn(self.engine))
        except Exception as e:  # the caller's error (bad input...), not the loop's
            cmd.future.set_exception(e)

    def _fail_pending(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None:
                self._fail(cmd)

    @staticmethod
    def _fail(cmd: _Command) -> None:
        if cmd.future.set_running_or_notify_cancel():
            cmd.future.set_exception(RuntimeError("engine loop is stopped"))
