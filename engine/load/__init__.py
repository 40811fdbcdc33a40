"""Reading a checkpoint into a model: safetensors and GGUF files, the compute dtype, weight-only
quantization and prepacked layouts. Nothing here runs during a step."""
