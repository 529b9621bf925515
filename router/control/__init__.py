"""A request's lifecycle over the workers (``orchestrator``, tunables in ``config``): per-request
and per-worker state (``request_state``), the workers a request goes to (``chooser``), each
decode worker's token fan-out (``fanout``), worker health (``worker_health``), requests whose
router died (``orphans``) and cluster-wide usage counters (``usage``)."""
