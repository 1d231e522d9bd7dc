"""The model on its device: loading, paged attention and KV tensors, the runner, CUDA graphs, CPU weight packing."""
