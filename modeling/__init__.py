"""Models: loading tokenizers, models, the reference and LoRA adapters; the packed forward."""
