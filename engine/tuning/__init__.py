"""Timing this host's kernel choices (at start-up, ahead of it, or measured for `pdcluster
profile`) and caching them per host."""
