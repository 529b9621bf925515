"""Tensor parallelism: which slice of the model a rank holds (``sharding``), the collectives
the sharded model calls (``comm``) and the follower ranks a rank-0 engine drives
(``ranks``)."""
