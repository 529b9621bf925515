"""Planning a cluster from measurements: the workload (``workload``), a discrete-event model
of the cluster driven by an engine profile (``simulator``; the profile: ``engine.tuning.profile``),
the search over splits for the most goodput per worker within an SLO (``plan``), and what a profile
adds beyond the bare engine's steps (``served_profile``, ``loopback``)."""
