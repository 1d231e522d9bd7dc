"""chatserve's HTTP side: the Ray Serve ingress, its dialects, and how outputs are read.

  app.py         `serve run` entry point (build_app)
  ingress.py     the ingress deployment's routes
  worker_call.py the one place that calls a model worker
  handle_api.py  typed Python entry points for other Ray apps
  http/          body limits, errors, SSE, API keys, metrics
  dialects/      one module (or package) per request dialect, and what they share
  output/        reasoning, tool calls and content read out of a choice's text
  media.py       where images may come from
  lora_adapters.py  which model or LoRA adapter a request names; load/unload rules
  lora_registry.py  the adapters loaded at run time, shared by every ingress replica
"""
