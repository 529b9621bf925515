"""Benchmarks that load a running server (``pdcluster bench serve``; ``pdcluster bench compare``
of its results) and what they share: the target server, its engines' step counters."""
