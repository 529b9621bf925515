"""The ``pdcluster`` command: the parser and the small commands (``main``), ``serve`` (its flags
and run in ``serve``, its configuration in ``serve_config``). ``python -m router.cli`` runs it."""
