"""Simulated hosts on one Linux machine: network namespaces on a private bridge, each with its
own IP, running a real multi-node Ray cluster (docs/deployment.md, "Three simulated hosts on one machine").

Every host is a network namespace with one veth into a bridge that lives in a namespace of
its own (the "switch"), so nothing touches the machine's own network stack and no packet can
leave the machine: the subnet exists only inside namespaces this module creates and deletes.
Taking a host's link down (``link_down``) is the switch-side ``ip link set ... down``.

Ownership: a ``SimCluster`` owns its namespaces and every process running in them. ``close``
ends them by pid (``ip netns pids``: the processes inside a namespace we created are ours by
construction, including Ray's daemons and the workers they fork), then deletes the
namespaces, which removes the veths and the bridge with them.

Used by the multi-host tests, by ``bench ttft_breakdown --hosts 2`` and by
``deploy/ray/local_multinode.sh up --netns`` (``python -m bench.cluster.simhosts up|down|status``).
Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Private, test-only addresses: they exist only inside this module's namespaces.
SUBNET_PREFIX = "10.231"
RAY_PORT = 6379  # each namespace has its own port space: no clash with the machine's Redis
_OBJECT_STORE_BYTES = 100_000_000  # every node shares one machine's /dev/shm
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class HostSpec:
    """One simulated host: a name and the Ray resources its node offers."""

    name: str
    resources: dict[str, float] = field(default_factory=dict)
    num_cpus: int = 1


@dataclass(frozen=True)
class SimHost:
    name: str
    netns: str
    ip: str
    switch_port: str  # the bridge-side veth (in the switch namespace)


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be built here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"pdc-probe-{secrets.token_hex(3)}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip()}")


class SimCluster:
    """Hosts, then (optionally) a Ray cluster across them: the first host runs the head.

    ``SimCluster(specs).create()`` builds the hosts; ``start_ray()`` starts one Ray node per
    host; ``popen`` / ``run`` execute commands on a host; ``close()`` ends everything. A
    context manager does create + close. ``tag`` names every namespace (``pdc-<tag>-...``).
    """

    def __init__(self, specs: list[HostSpec], tag: str | None = None,
                 state_dir: Path | None = None, ray_bin: str | None = None) -> None:
        if not specs:
            raise ValueError("at least one host is needed")
        self.specs = specs
        self.tag = tag or secrets.token_hex(3)
        self.state_dir = state_dir or Path("/tmp") / f"pdc-sim-{self.tag}"  # short: socket paths
        self.ray_bin = ray_bin or str(Path(sys.executable).parent / "ray")
        # The third octet keeps two concurrent clusters (two CI jobs) on disjoint subnets.
        self.subnet = f"{SUBNET_PREFIX}.{zlib.crc32(self.tag.encode()) % 250 + 1}"
        self.switch = f"pdc-{self.tag}-sw"
        self.hosts = [SimHost(s.name, f"pdc-{self.tag}-{i}", f"{self.subnet}.{i + 1}",
                              f"pdc{self.tag}p{i}") for i, s in enumerate(specs)]
        self._procs: list[subprocess.Popen] = []

    # ---- hosts --------------------------------------------------------------------------------
    def create(self) -> SimCluster:
        """Build the switch and the hosts; on failure, whatever was built is removed."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.switch_port, "type", "veth", "peer", "name", "eth0",
                    "netns", h.netns)
                _ip("link", "set", h.switch_port, "netns", self.switch)
                _ip("link", "set", h.switch_port, "master", "br0", netns=self.switch)
                _ip("link", "set", h.switch_port, "up", netns=self.switch)
                _ip("addr", "add", f"{h.ip}/24", "dev", "eth0", netns=h.netns)
                _ip("link", "set", "eth0", "up", netns=h.netns)
                _ip("link", "set", "lo", "up", netns=h.netns)
                # A default route (to nowhere: the switch has no uplink) so that "which
                # address would I use" lookups (Ray's node-IP probe) answer with eth0's.
                _ip("route", "add", "default", "dev", "eth0", netns=h.netns)
                self._write_netns_etc(h)
            self._save_state()
        except BaseException:
            self.close()
            raise
        return self

    def _write_netns_etc(self, h: SimHost) -> None:
        """``ip netns exec`` bind-mounts /etc/netns/<ns>/* over /etc: give each host its own
        hosts file (the machine's hostname is this host's IP, every simulated host by name)
        and a resolver that fails at once. Otherwise c10d's and gloo's name lookups wait
        for a DNS server the namespace cannot reach: seconds per new KV connection."""
        etc = Path("/etc/netns") / h.netns
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{o.ip} {o.name}\n" for o in self.hosts if o is not h)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{h.ip} {socket.gethostname()} "
                                   f"{h.name}\n{names}")
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def host(self, name: str) -> SimHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no simulated host {name!r}; hosts: {[h.name for h in self.hosts]}")

    def link_down(self, name: str) -> None:
        """Cut the host off the bridge (its processes keep running, unreachable)."""
        _ip("link", "set", self.host(name).switch_port, "down", netns=self.switch)

    def link_up(self, name: str) -> None:
        _ip("link", "set", self.host(name).switch_port, "up", netns=self.switch)

    # ---- processes ----------------------------------------------------------------------------
    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``name`` in its own process group (ended by ``close``)."""
        env = {**os.environ, **kwargs.pop("env", {}), "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.Popen(["ip", "netns", "exec", self.host(name).netns, *argv],
                                env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: list[str], timeout_s: float = 120.0,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``name`` to completion (killed by process group on timeout)."""
        proc = self.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise TimeoutError(f"{argv[:3]} on {name} ran past {timeout_s}s: {err[-2000:]}") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def measure_bandwidth_gb_s(self, src: str, dst: str, nbytes: int = 256 << 20) -> float:
        """TCP throughput from host ``src`` to host ``dst`` over the bridge (one stream, what
        the receiver counts from the first byte to the last)."""
        receiver = (
            "import socket, sys, time\n"
            f"srv = socket.create_server(('{self.host(dst).ip}', 5201))\n"
            "print('ready', flush=True)\n"
            "conn, _ = srv.accept(); n = 0; buf = bytearray(1 << 20); t0 = None\n"
            f"while n < {nbytes}:\n"
            "    k = conn.recv_into(buf)\n"
            "    t0 = t0 or time.perf_counter(); n += k\n"
            "    if not k: break\n"
            "print(n / (time.perf_counter() - t0) / 1e9, flush=True)\n")
        sender = (
            "import socket\n"
            f"s = socket.create_connection(('{self.host(dst).ip}', 5201))\n"
            f"chunk = bytes(1 << 20)\nfor _ in range({nbytes >> 20}): s.sendall(chunk)\n"
            "s.close()\n")
        rx = self.popen(dst, [sys.executable, "-c", receiver], stdout=subprocess.PIPE, text=True)
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
            tx = self.run(src, [sys.executable, "-c", sender], timeout_s=120)
            if tx.returncode != 0:
                raise RuntimeError(f"bandwidth sender failed: {tx.stderr[-1000:]}")
            return float(rx.communicate(timeout=60)[0].strip())
        finally:
            if rx.poll() is None:
                os.killpg(rx.pid, signal.SIGKILL)
                rx.wait()

    # ---- Ray ----------------------------------------------------------------------------------
    @property
    def ray_address(self) -> str:
        return f"{self.hosts[0].ip}:{RAY_PORT}"

    def start_ray(self) -> str:
        """One Ray node per host (the first is the head); returns the GCS address."""
        temp_dir = self.state_dir / "ray"
        for i, (h, spec) in enumerate(zip(self.hosts, self.specs, strict=True)):
            args = [self.ray_bin, "start", f"--node-ip-address={h.ip}",
                    f"--num-cpus={spec.num_cpus}", f"--resources={json.dumps(spec.resources)}",
                    f"--object-store-memory={_OBJECT_STORE_BYTES}", "--disable-usage-stats"]
            if i == 0:
                args += ["--head", f"--port={RAY_PORT}", f"--temp-dir={temp_dir}",
                         "--include-dashboard=false", "--dashboard-host=127.0.0.1"]
            else:  # worker nodes take the head's session directory
                args += [f"--address={self.ray_address}"]
            log_path = self.state_dir / f"ray-{h.name}.log"
            # Ray's own node health check (GCS <-> raylet) gets a minute before it declares a
            # cut-off host dead: failure tests cut links for seconds, and what they exercise
            # is pdcluster's own deadlines, which must notice first.
            env = {"RAY_health_check_failure_threshold": "20"} if i == 0 else {}
            with log_path.open("w") as log:
                # `ray start` returns once the node is up; its daemons stay in the namespace.
                proc = self.popen(h.name, args, stdout=log, stderr=subprocess.STDOUT, env=env)
                try:
                    code = proc.wait(_START_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    code = None
            if code != 0:
                raise RuntimeError(f"ray node on simulated host {h.name} failed to start: "
                                   f"{log_path.read_text()[-3000:]}")
        return self.ray_address

    # ---- teardown -----------------------------------------------------------------------------
    def pids(self) -> dict[str, list[int]]:
        """Live processes per namespace of this cluster."""
        out = {}
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            out[ns] = [int(p) for p in res.stdout.split()] if res.returncode == 0 else []
        return out

    def close(self, grace_s: float = 5.0) -> None:
        """End every process in the namespaces (SIGTERM, then SIGKILL), delete them. Idempotent."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            pids = [p for ps in self.pids().values() for p in ps]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while any(self.pids().values()) and time.monotonic() < deadline:
                time.sleep(0.2)
        for proc in self._procs:  # reap our direct children (the `ip netns exec` wrappers)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1)
        for ns in [h.netns for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> SimCluster:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_state(self) -> None:
        state = {"tag": self.tag, "specs": [asdict(s) for s in self.specs]}
        (self.state_dir / "state.json").write_text(json.dumps(state))

    @classmethod
    def load(cls, state_dir: Path) -> SimCluster:
        """The cluster recorded in ``state_dir`` (for ``down`` / ``status`` from a CLI)."""
        state = json.loads((state_dir / "state.json").read_text())
        return cls([HostSpec(**s) for s in state["specs"]], tag=state["tag"], state_dir=state_dir)


def parse_host(text: str) -> HostSpec:
    """``name[:res=n,res=n]`` -> HostSpec, e.g. ``decode:decode_slot=2``."""
    name, _, res = text.partition(":")
    resources = {}
    for item in filter(None, res.split(",")):
        key, _, value = item.partition("=")
        resources[key] = float(value or 1)
    return HostSpec(name, resources)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.simhosts", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("up", "down", "status"))
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--hosts", nargs="+", type=parse_host,
                   default=[parse_host("head:router=1"), parse_host("prefill:prefill_slot=2"),
                            parse_host("decode:decode_slot=2")])
    p.add_argument("--num-cpus", type=int, default=2, help="logical CPUs each Ray node offers")
    p.add_argument("--no-ray", action="store_true", help="hosts only, no Ray nodes")
    args = p.parse_args(argv)
    args.hosts = [HostSpec(h.name, h.resources, args.num_cpus) for h in args.hosts]
    if args.command == "up":
        reason = unavailable_reason()
        if reason:
            print(f"cannot build simulated hosts: {reason}", file=sys.stderr)
            return 1
        tag = secrets.token_hex(3)
        cluster = SimCluster(args.hosts, tag=tag, state_dir=args.state_dir).create()
        try:
            if not args.no_ray:
                cluster.start_ray()
        except BaseException:
            cluster.close()
            raise
        for h in cluster.hosts:
            print(f"host {h.name}: {h.ip} (netns {h.netns})")
        if not args.no_ray:
            print(f"RAY_ADDRESS={cluster.ray_address}")
            print(f"run on a host: ip netns exec {cluster.hosts[0].netns} <command>")
        return 0
    if not (args.state_dir / "state.json").exists():
        print(f"not running (no {args.state_dir / 'state.json'})")
        return 1 if args.command == "status" else 0
    cluster = SimCluster.load(args.state_dir)
    if args.command == "status":
        for ns, pids in cluster.pids().items():
            print(f"{ns}: {len(pids)} processes")
        return 0
    cluster.close()
    print("simulated hosts down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
