"""The cluster's shared metadata: the store contract (``store``), its implementations
(``memory``, ``redis_store``, ``resilient``), the factory that picks one (``factory``), and the
resumable stream logs kept in it (``stream_log``)."""
