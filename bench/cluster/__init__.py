"""Benchmarks that start a cluster of their own (``pdcluster bench ttft_breakdown``, ``disagg``,
``chaos``, ``prefix`` (a package), ``autoscale``, ``plan``, ``neighbour``) and the simulated hosts
(network namespaces) that tests, ``--hosts 2`` and ``deploy/ray/local_multinode.sh --netns`` run
on."""
