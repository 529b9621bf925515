"""Names of the custom Ray resources that place prefill and decode workers on their nodes.

Prefill is compute-bound and decode is memory-bound, so a cluster gives each kind its own
node pool (deploy/ray/cluster.yaml, deploy/k8s/, deploy/ray/local_multinode.sh). A node
advertises how many workers of a kind it can host as a custom resource, and each worker
actor asks for one unit of it (plus ``num_gpus=1`` on GPU nodes), so Ray puts prefill
workers only on prefill nodes and decode workers only on decode nodes. The deployment files
spell these same strings; tests/unit/test_ray_launcher.py keeps the two in step.
"""

PREFILL_RESOURCE = "prefill_slot"
"""Custom resource a prefill worker actor requests one unit of (``resources={...: 1}``)."""

DECODE_RESOURCE = "decode_slot"
"""Custom resource a decode worker actor requests one unit of (``resources={...: 1}``)."""
