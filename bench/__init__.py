"""Benchmarks and the code they share; bench/README.md is the map.

Product benchmarks (``pdcluster bench <name>``, mounted by ``bench.cli``) by what they drive:
``bench.engine``, ``bench.server``, ``bench.cluster``. One-off investigations
(``python -m bench.studies.<name>``): ``bench.studies``. Shared helpers: ``bench.harness``.
"""
