"""Reading a model: checkpoints (safetensors, GGUF), their configs, their tokenizers."""
