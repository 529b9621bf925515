"""The drivers: the single-process engine (its parts built by ``build``) and its KV connector,
the compute thread, the engine loop, the asyncio face, thread counts, and a tensor-parallel
follower rank."""
