"""LoRA adapters on one base model (``--enable-lora``): ``request`` (``LoRARequest``, what a
caller names; no torch), ``peft_format`` (a PEFT adapter read, checked and laid out against our
fused projections), ``registry`` (the adapters an engine holds, LRU), ``rows`` (one step's rows
grouped by adapter: the batched shrink and expand added to each projection)."""
