"""chatserve's HTTP side: the Ray Serve ingress, its dialects, and how outputs are read.

The root holds the top: what binds the app and answers requests. Every package below
imports only packages further down (tests/unit/contract/test_layout.py).

  app.py         `serve run` entry point (build_app)
  launch.py      `make serve`'s command: `serve run` in a Ray without the dashboard
  ingress.py     the ingress deployment: its routes and the one generate path
  handle_api.py  typed Python entry points for other Ray apps (the same path)
  dialects/      one module (or package) per request dialect, and the table of them
  output/        reasoning, tool calls and content read out of a choice's text
  schema/        what dialects and output parsers share: request/response bases,
                 response_format, tool definitions, the `Dialect` row
  lora/          which model or LoRA adapter a request names; load/unload; the registry
  media/         where images may come from
  transport/     the one worker call, and the channels that carry a worker's chunks
  http/          body limits, errors, SSE, API keys, metrics
  config/        the app config (the Serve YAML's `args`)
"""
