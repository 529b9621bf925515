"""The engine's pure core, torch-free: requests, the scheduler, the paged block manager and its
prefix cache, grammar bookkeeping, KV events and step times. Reads in one sitting."""
