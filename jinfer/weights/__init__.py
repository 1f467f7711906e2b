"""Weight formats: HF safetensors directories, GGUF files, orbax checkpoints of jinfer params."""
