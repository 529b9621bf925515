"""What every worker process does at start-up, whichever its kind: CPU pinning, which Ray
node it is on, which address its KV endpoints bind and advertise (docs/deployment.md, "Across real machines: addresses and ports"), and putting
its start-up heap out of the garbage collector's reach."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)


def apply_cpu_affinity(cores: tuple[int, ...] | None) -> None:
    """Pin this process to ``cores`` (Linux); torch then uses one thread per pinned core."""
    if not cores:
        return
    import torch

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


def restore_priority() -> int:
    """Give this worker process the scheduling priority of the process that started it (the
    node's raylet), undoing Ray's default worker niceness of 15; returns the nice value the
    process runs at. Call first in a worker's constructor: threads started later inherit it.

    Why: at nice 15 a worker gets 1/29 of a core shared with any nice-0 process (a neighbour,
    or the router itself), and a nice-19 neighbour 30% of it. ``pdcluster serve`` starts its
    local Ray with ``worker_niceness`` 0 (router.cluster.local_ray); a cluster started by
    ``ray start`` needs ``RAY_worker_niceness=0`` in its environment (the deploy manifests set
    it) or, lacking that, this: lowering a nice value needs CAP_SYS_NICE, so without it the
    worker logs a warning naming the variable and runs as it was started."""
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        parent = os.getpriority(os.PRIO_PROCESS, os.getppid())
    except OSError:
        return 0
    if mine <= parent:
        return mine
    try:
        for tid in os.listdir("/proc/self/task"):  # nice is per thread on Linux
            os.setpriority(os.PRIO_PROCESS, int(tid), parent)
    except OSError as e:
        log.warning("worker runs at nice %d (its node's Ray runs at %d) and cannot change it "
                    "(%s): start Ray with RAY_worker_niceness=0 in its environment", mine,
                    parent, e.strerror)
        return os.getpriority(os.PRIO_PROCESS, 0)
    log.info("worker priority restored: nice %d -> %d (Ray's worker_niceness)", mine, parent)
    return parent


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's reach; returns how many
    are frozen. Call once, at the end of start-up (workers, the router).

    A process with torch, Ray and a model holds ~300k objects after start-up, and Python's
    full (generation 2) collection walks them all: ~190 ms here (``python -m bench.studies.gc_pause``),
    on whichever thread happens to allocate, so an engine step (an inter-token gap for every
    sequence in the batch) or the router's event loop (every stream) stops that long. Frozen
    objects are never walked again; what requests allocate later is collected as before."""
    import gc

    gc.collect()  # freeze only what is still alive
    gc.freeze()
    return gc.get_freeze_count()


def current_node_id() -> str:
    """The Ray node this process runs on, or "local" outside Ray (tests build workers bare)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def new_incarnation() -> str:
    """A fresh id for this start of a worker process (``WorkerInfo.incarnation``)."""
    import uuid

    return uuid.uuid4().hex[:12]


def restarted_by_ray() -> bool:
    """Whether Ray restarted this actor after its process died (its constructor is running
    again). Fault injection fires in the first incarnation only, so a test's failure happens
    once and the restarted worker serves."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed


def actor_state(handle) -> str | None:
    """Ray's own record (the GCS actor table) of the actor behind ``handle``: "ALIVE",
    "RESTARTING" (its process died; Ray is starting a new one), "DEAD", "PENDING_CREATION",
    ...; None when it cannot be read. The table flips within ~0.1 s of a process's death,
    seconds before calls to it fail (calls to a restarting actor wait for the new process).
    A blocking GCS round trip of about a millisecond: call it off an event loop."""
    try:
        from ray._private import state  # the public state API needs the dashboard

        return state.actors(handle._actor_id.hex()).get("State")
    except Exception:  # not connected, an unknown id, another Ray version's shape
        return None


def exit_on_engine_crash(worker_id: str):
    """An ``EngineLoop.on_crash`` for a Ray worker: a loop that died leaves an engine in an
    unknown state, so the process exits and Ray restarts the actor (or, past its restarts,
    reports it dead); the router moves its requests instead of the worker looking alive and
    hanging.
    Outside Ray (a worker built in a test) it only logs."""

    def on_crash(error: BaseException) -> None:
        import ray

        log.critical("%s: engine loop crashed (%r); the worker exits", worker_id, error)
        if ray.is_initialized():
            os._exit(70)  # EX_SOFTWARE

    return on_crash


def current_node_ip() -> str:
    """The address of the host this process runs on (its Ray node's), loopback outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else _LOOPBACK


# Set per node (e.g. from a Kubernetes pod's IP through the downward API); Ray actors inherit
# the environment of their node's `ray start`. The only place the variable is read.
KV_HOST_ENV = "PDCLUSTER_KV_HOST"
_LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class KVHost:
    """The address a worker binds and advertises for KV transfer, and why that one."""

    address: str
    source: str  # for the start-up log line: which rule chose it

    @property
    def is_loopback(self) -> bool:
        return self.address.startswith("127.") or self.address in ("::1", "localhost")


def resolve_kv_host(kv_host: str | None = None, kv_interface: str | None = None) -> KVHost:
    """Where this worker's KV endpoints listen, reachable from the other hosts.

    In order: an explicit ``kv_host``; the IPv4 address of ``kv_interface`` on this host (a
    second NIC); ``$PDCLUSTER_KV_HOST`` of this node; the Ray node IP of this host; loopback
    outside Ray. Raises ValueError for an interface this host does not have.
    """
    if kv_host:
        return KVHost(kv_host, "--kv-host")
    if kv_interface:
        return KVHost(interface_ipv4(kv_interface), f"--kv-interface {kv_interface}")
    if os.environ.get(KV_HOST_ENV):
        return KVHost(os.environ[KV_HOST_ENV], KV_HOST_ENV)
    import ray

    if ray.is_initialized():
        return KVHost(current_node_ip(), "Ray node IP")
    return KVHost(_LOOPBACK, "loopback (not in Ray)")


def interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this host (ValueError if none)."""
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)
        except OSError as e:
            names = [n for _, n in socket.if_nameindex()]
            raise ValueError(f"network interface {name!r} has no IPv4 address on this host "
                             f"({e.strerror}); interfaces: {', '.join(names)}") from None
    return socket.inet_ntoa(res[20:24])


def interface_for_ipv4(address: str) -> str | None:
    """The interface holding ``address`` on this host, or None (NCCL's bootstrap binds by
    interface name, ``NCCL_SOCKET_IFNAME``)."""
    for _, name in socket.if_nameindex():
        try:
            if interface_ipv4(name) == address:
                return name
        except ValueError:
            continue
    return None


def kv_host_for(worker_id: str, kv_host: str | None, kv_interface: str | None,
                device_type: str) -> KVHost:
    """Resolve the worker's KV address, pin NCCL to its interface on GPU, log the choice."""
    host = resolve_kv_host(kv_host, kv_interface)
    if device_type == "cuda":
        pin_nccl_to(host)
    log.info("%s: KV endpoints on %s (%s)", worker_id, host.address, host.source)
    return host


def pin_nccl_to(host: KVHost) -> None:
    """Make NCCL bootstrap on the KV address's interface unless the operator chose one."""
    if host.is_loopback or os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    name = interface_for_ipv4(host.address)
    if name is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = name
