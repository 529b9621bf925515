"""deploy/ray/local_multinode.sh from tests: run it, check its processes, and what `up` left
(tests/integration/multinode/conftest.py holds one such cluster for the package)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.redis_server import OwnRedis

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "deploy" / "ray" / "local_multinode.sh"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent can reap it


def stop_workers(address: str, name: str, env: dict) -> subprocess.CompletedProcess:
    """`pdcluster stop --name name` on the package's Ray: a test that failed before its own
    stop leaves detached workers there (--keep-workers, or a router killed), which would hold
    the nodes' prefill and decode slots from the package's next tests."""
    import sys

    return subprocess.run([sys.executable, "-m", "router.cli", "stop", "--ray-address", address,
                           "--name", name], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO_ROOT)


def run_script(cmd: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), cmd, *args], env=env, capture_output=True,
                          text=True, timeout=180, check=False)


@dataclass(frozen=True)
class Deployment:
    env: dict  # for the script, routers and drivers: the cluster's port and state dir
    address: str  # the head's GCS address
    redis: OwnRedis
    up_stdout: str
    pids: list[int]  # every process `up` started (its state dir's "pids" file)
    state_dir: Path
