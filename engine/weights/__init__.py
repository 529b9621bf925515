"""Finding a model and reading its weights: Hugging Face directories, safetensors, GGUF files."""
