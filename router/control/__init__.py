"""A request's lifecycle over the workers (``orchestrator``, tunables in ``config``): per-request
and per-worker state (``request_state``), the workers a request goes to (``chooser``), each
decode worker's token fan-out (``fanout``), one worker call and what its failure costs
(``worker_calls``), worker health (``worker_health``), requests whose router died
(``orphans``), cluster-wide usage counters (``usage``), prefix pulls (``prefix_pull``),
operators' drains (``drain``) and the autoscaler's decision rule (``autoscaler``)."""
