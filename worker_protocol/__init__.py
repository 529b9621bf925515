"""The vocabulary the router and both worker kinds share: request/reply messages, load reports,
worker configuration, and what every worker process does at start-up.

Neither worker package imports the other; both, and the router, import this one.
"""

from worker_protocol.messages import (
    CONTROL_GROUP,
    CONTROL_GROUP_THREADS,
    LIVENESS_GROUP,
    LIVENESS_GROUP_THREADS,
    AbortRequest,
    CommitRequest,
    CommitResult,
    PrefillRequest,
    PrefillResult,
    PrefillTimeoutError,
    RequestTokens,
    ReserveRequest,
    ReserveResult,
    SubmitRequest,
    TokenBatch,
    TokenUpdate,
    WorkerConfig,
    WorkerInfo,
    WorkerLoad,
    control,
    liveness,
)
from worker_protocol.runtime import (
    KVHost,
    actor_state,
    apply_cpu_affinity,
    current_node_id,
    current_node_ip,
    exit_on_engine_crash,
    freeze_startup_heap,
    kv_host_for,
    new_incarnation,
    pin_nccl_to,
    resolve_kv_host,
    restarted_by_ray,
    restore_priority,
)

__all__ = [
    "CONTROL_GROUP", "CONTROL_GROUP_THREADS", "control",
    "LIVENESS_GROUP", "LIVENESS_GROUP_THREADS", "liveness",
    "AbortRequest", "CommitRequest", "CommitResult", "PrefillRequest", "PrefillResult",
    "PrefillTimeoutError",
    "RequestTokens", "ReserveRequest", "ReserveResult", "SubmitRequest", "TokenBatch", "TokenUpdate",
    "KVHost", "WorkerConfig", "WorkerInfo", "WorkerLoad", "actor_state", "apply_cpu_affinity",
    "current_node_id", "current_node_ip", "exit_on_engine_crash",
    "freeze_startup_heap", "kv_host_for", "new_incarnation",
    "pin_nccl_to", "resolve_kv_host", "restarted_by_ray", "restore_priority",
]
