"""One three-node local Ray (deploy/ray/local_multinode.sh: head, prefill node, decode node)
and a Redis for every module of this package: `up` and `down` cost ~15-20 s together, and
the script's own test and the router-restart tests each paid them. `make test` hands this
package to one pytest worker whole (tests/conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.multinode import Deployment, alive, run_script
from tests.helpers.redis_server import OwnRedis

PORT = 6480  # the Ray head's GCS port: apart from a developer's cluster (6390)


@pytest.fixture(scope="package")
def deployment():
    """`up` on 127.0.0.2:PORT with a state dir of this pytest process's own, and a Redis of
    its own. After the package's last test, `down` must leave none of the cluster's processes
    nor its state dir, and `status` then fails (what deploy/ray/local_multinode.sh promises)."""
    state_dir = Path("/tmp") / f"pdc-ray-mn-{os.getpid()}"  # short: unix socket path limit
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, PDC_RAY_PORT=str(PORT), PDC_RAY_STATE_DIR=str(state_dir),
               PDC_RAY_GRACE_S="5", PDC_RAY_BIN=ray_bin, RAY_AUTH_MODE="disabled")
    redis = OwnRedis()
    redis.start()
    pids: list[int] = []
    try:  # `up` itself inside: one that times out still gets its `down` and the Redis ended
        up = run_script("up", env)
        assert up.returncode == 0, up.stdout + up.stderr
        pids = [int(line.split()[0]) for line in (state_dir / "pids").read_text().splitlines()]
        yield Deployment(env, f"127.0.0.2:{PORT}", redis, up.stdout, pids, state_dir)
    finally:
        down = run_script("down", env)
        redis.kill()
    assert down.returncode == 0, down.stdout + down.stderr
    assert [p for p in pids if alive(p)] == []
    assert not state_dir.exists()
    assert run_script("status", env).returncode == 1
