"""The in-process engine: the model runner (one forward pass over a batch of sequences), CUDA graph
capture, the pipelined decode loop, speculative decoding, and the memory plan that splits a VRAM budget."""
