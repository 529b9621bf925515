"""The router: the front doors and everything behind them up to the workers.

Imports go one way (tests/unit/project/test_import_rules.py keeps it so):

    cli -> cluster -> control -> routing, state -> contract
    cli -> frontdoor -> contract          cli -> embedded -> state, contract
    cli -> planning -> cluster, contract

- ``contract.py``: what the front doors need of a backend (request/chunk types, typed errors);
  ``embedded.py``: one in-process engine behind it.
- ``frontdoor/``: gRPC and OpenAI-compatible HTTP servers, their auth gate, error mapping and
  metrics; they import only ``contract``.
- ``control/``: a request's lifecycle over the workers (reserve -> prefill -> transfer ->
  decode -> stream), worker health, token fan-out, migration, orphaned requests.
- ``routing/``: which workers a request goes to (policy) and the picture of their prefix caches
  (KV index and its sync); imports no other router package.
- ``state/``: the cluster store (contract, in-memory, Redis, resilient wrapper, factory) and the
  resumable stream logs.
- ``cluster/``: Ray start/join, the worker launcher and placement, thread plans; ``Cluster``
  (``cluster/ray_cluster.py``) is the backend over Ray workers.
- ``planning/``: ``pdcluster plan``'s workloads, cluster simulator and split search, and the
  served profile (measured on a ``Cluster``).
- ``cli/``: the ``pdcluster`` command (``python -m router.cli``).
- ``observability/``: the Grafana dashboards and Prometheus alert rules of
  ``deploy/observability/``, generated (``python -m router.observability.dashboards``); a
  developer's tool that imports no other router package.
"""
