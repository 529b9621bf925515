"""Compute kernels: the C library built for this host (csrc/), its quantized linear wrappers and
the linear layer's paths and their dispatch (``linear``; timed per host by engine.tuning)."""
