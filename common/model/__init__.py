"""The models as plain PyTorch: the Hugging Face architectures (qwen3_moe, qwen2_moe, mixtral; qwen4_exp/),
their layers, the expert-provider seam the MoE blocks are written against (with the all-resident provider),
block-scaled fp8 weights, the architecture registry and the checkpoint loader; synthetic/ writes
checkpoints."""
