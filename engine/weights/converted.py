"""What a directory converted from a GGUF holds, shared by the converter
(``engine.weights.gguf_convert``), the cache that decides when to convert
(``engine.weights.resolve``) and the loader that reads it (``engine.weights.loader``)."""

# Bump when what the converter writes changes (5: Mixtral, Qwen2/3-MoE, Phi-3): the cache key
# includes it, so every cached conversion is made again.
CONVERTER_VERSION = "5"
# The projections' GGUF blocks as stored, beside the fp32 ``model.safetensors``.
QUANTIZED_FILE = "quantized.safetensors"
