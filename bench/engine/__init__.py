"""Benchmarks that drive an engine in this process (``pdcluster bench ceilings``, ``kernels``,
``sweep``, ``policies``; ``python -m bench.engine.engine_compare``) and the helpers only they
use (``step_split``, ``baseline_hf``)."""
