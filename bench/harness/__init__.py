"""What every benchmark and study builds on, one role a module; none of them is a benchmark.

``workload`` (seeded prompts, output lengths, arrivals), ``stats`` (percentiles, summaries),
``report`` (results folder, machine info, strict JSON, the targets table), ``engine_under_test``
(loading the engine, its size, timing its steps), ``roofline`` (roofline model, knee),
``batching`` (slot utilization, static vs continuous), ``otlp_receiver`` (an OTLP trace
collector for tests and studies), ``serve_ab`` (server set-ups A/B under one `bench serve`
load; starting and stopping a `pdcluster serve` process).
"""
