"""The vocabulary the router and both worker kinds share: request/reply messages, load reports,
worker configuration, and what every worker process does at start-up.

Neither worker package imports the other; both, and the router, import this one.
"""

from worker_protocol.messages import (
    AbortRequest,
    CommitRequest,
    CommitResult,
    PrefillRequest,
    PrefillResult,
    ReserveRequest,
    ReserveResult,
    SubmitRequest,
    TokenBatch,
    TokenUpdate,
    WorkerConfig,
    WorkerInfo,
    WorkerLoad,
)
from worker_protocol.runtime import (
    KVHost,
    apply_cpu_affinity,
    current_node_id,
    current_node_ip,
    kv_host_for,
    pin_nccl_to,
    resolve_kv_host,
)

__all__ = [
    "AbortRequest", "CommitRequest", "CommitResult", "PrefillRequest", "PrefillResult",
    "ReserveRequest", "ReserveResult", "SubmitRequest", "TokenBatch", "TokenUpdate",
    "KVHost", "WorkerConfig", "WorkerInfo", "WorkerLoad", "apply_cpu_affinity",
    "current_node_id", "current_node_ip", "kv_host_for", "pin_nccl_to", "resolve_kv_host",
]
