"""Benchmarks that start a cluster of their own (``pdcluster bench ttft_breakdown``, ``disagg``,
``prefix``, ``chaos``) and the simulated hosts (network namespaces) that tests, ``--hosts 2`` and
``deploy/ray/local_multinode.sh --netns`` run on."""
