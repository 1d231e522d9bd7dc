"""The torch-free contract between the ingress (serve_app/) and the model workers.

Everything that crosses a Ray handle, and everything both sides must agree on, lives
here and imports neither torch nor transformers: requests and sampling parameters,
streamed chunks and errors, a worker's info and stats, grammar validation, the model
config. tests/unit/contract checks that importing the ingress pulls in no torch.
"""
