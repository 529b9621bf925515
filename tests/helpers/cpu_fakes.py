"""Stand-ins for the clock and the stolen-time reader that engine.runtime.cpu_threads.EngineThreads
takes, so a test decides when a window ends and what it lost."""

from __future__ import annotations

from engine.runtime.cpu_threads import GovernorConfig

CFG = GovernorConfig()


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeStolen:
    """StolenTime's read(): scripted (wall, stolen, idle) tuples, then quiet ones."""

    def __init__(self) -> None:
        self.script: list[tuple[float, float, float]] = []
        self.reads = 0

    def read(self) -> tuple[float, float, float]:
        self.reads += 1
        return self.script.pop(0) if self.script else (CFG.window_s, 0.0, 0.0)
