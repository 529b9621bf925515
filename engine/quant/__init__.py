"""Weight-only quantization: the int8/int4 layouts, GGUF's blocks repacked into them, CUDA's."""
