"""Planning a cluster from measurements: the workload (``workload``), a discrete-event model
of the cluster driven by an engine profile (``simulator``; the profile: ``engine.tuning.profile``),
and the search over splits for the most goodput per worker within an SLO (``plan``)."""
