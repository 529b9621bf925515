"""Benchmarks that load a running server (`pdcluster bench serve`, `pdcluster bench compare` of
their results) and the pieces they share: the target server, its engine counters."""
