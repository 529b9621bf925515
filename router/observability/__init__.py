"""Observability as code: the Grafana dashboards and Prometheus alert rules of
``deploy/observability/``, generated from Python so that they name only what the server exports.

- ``catalog.py``: the metric families the router's ``/metrics`` exports (names, kinds, labels)
  that dashboards and rules may read, and the SLOs they hold the cluster to;
- ``dashboards.py``: the four dashboards (cluster overview, disaggregation, KV cache, faults)
  and the command that writes or checks every generated file:
  ``python -m router.observability.dashboards [--check]``;
- ``alerts.py``: the alert rule groups; each alert has a section in ``docs/runbook.md``.

Nothing here runs in the server: it is a developer's tool (its libraries are in the ``dev``
extra). It imports no other router package: the metric names are checked against a live
server's scrape by ``tests/integration/frontdoor/test_dashboard_metrics.py``.
"""
