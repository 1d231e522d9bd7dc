"""Benchmarks: the load generator, the offline engine, the GPU engine, the CPU comparison against peers."""
