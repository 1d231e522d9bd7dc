"""Text at the worker's edges: chat templates and prompts in, incremental detokenizing and stop strings out."""
