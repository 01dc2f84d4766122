"""Synthetic checkpoints in the real Hugging Face layout (spillway make-model): presets, configs, the
tensors' plan, their deterministic random values, and a byte-level BPE tokenizer."""
