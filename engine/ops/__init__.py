"""Compute kernels: the C library built for this host (csrc/), its quantized linear wrappers and
the per-host choice of linear kernel."""
