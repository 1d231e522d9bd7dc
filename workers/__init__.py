"""chatserve's model workers: a continuous-batching engine over transformers models,
served as a Ray Serve deployment.

Packages, one concept each:
  contract  the torch-free contract with the ingress: requests, continuations, chunks, errors, configs
  engine    sequences, scheduler, KV blocks, the step loop (LLMEngine) and its helpers
  model     loading, paged attention, KV tensors, the model runner, CUDA graphs, CPU packing
  lora      LoRA adapters: PEFT files, device slots, the batched adapter layers
  sampling  the batched sampler, log-probabilities, grammar-guided masks
  text      chat templates and prompts, incremental detokenizing, stop strings
  serving   the Serve deployment, the engine thread behind asyncio, one request end to end

This file imports nothing: `workers.contract` must stay importable without torch.
"""
