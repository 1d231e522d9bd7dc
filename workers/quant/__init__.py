"""Weights kept in a checkpoint's quantized blocks, and the kernels that multiply with them."""
