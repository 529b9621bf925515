"""One-off investigations, each run as ``python -m bench.studies.<name>`` (``pdcluster bench``
does not list them); docs/benchmarks.md quotes what each found."""
