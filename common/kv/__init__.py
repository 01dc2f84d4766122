"""Per-sequence state: the pools (paged KV, fixed-size slots) and the specs a model declares, the forward
batch, the attention backends and the fp8 KV cache."""
