"""Speculative decoding: drafts proposed before a step, verified by the target in it.

``config`` (what a user asks for; no torch), ``ngram`` (prompt-lookup drafts), ``controller``
(how many drafts a step verifies, and the statistics), ``decoder`` (the engine's side of it).
The target's verification is ``engine.executor.verify``. docs/speculative-decoding.md.
"""
