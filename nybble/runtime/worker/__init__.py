"""One model step on one device: model runner, step inputs, CUDA graphs, KV cache."""
