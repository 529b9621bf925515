"""Routing: the policy that picks workers (``policy``) and the router's picture of every worker's
prefix cache (``kv_index``), kept current from the workers' KV events (``kv_sync``). Imports no
other router package."""
