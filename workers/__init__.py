"""chatserve engine: a continuous-batching LLM engine over transformers models.

Modules, one concept each:
  sampling_params  what a request asks of the sampler and the stopping rules
  sequence         one request's token state as the engine sees it
  block_manager    paged KV-cache bookkeeping: blocks, block tables, the prefix cache
  kv_cache         the KV tensors themselves, sized from a memory budget
  kv_sizing        that budget: configured, or what a profiled warm-up leaves on a GPU
  attention        paged attention plugged into transformers' attention interface
  model_runner     packs a scheduled batch, runs the model, returns logits
  sampler          batched temperature / top-k / top-p / seeded sampling
  scheduler        who runs this step: decodes, prefill chunks, preemption
  engine           the synchronous step loop tying the above together
  async_engine     the engine on a background thread, streams for asyncio callers
  detokenizer      incremental token-id -> text
  stop_strings     stop-string search with hold-back for streaming
  prompts          chat templating and prompt validation
  model_loader     model directory / GGUF / built-in default, with a converted cache
  request_processor  one request end to end: prompt -> engine -> text chunks
  deployment       the Ray Serve model-worker deployment
  bench_engine, bench_gpu  offline benchmarks (no Ray)
"""
