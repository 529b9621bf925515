"""Benchmarks that start a cluster of their own (`pdcluster bench ttft_breakdown|disagg|prefix|
chaos`) and the simulated hosts (network namespaces) that tests and `--hosts 2` run on."""
