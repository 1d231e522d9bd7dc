"""LoRA adapters at the ingress: which adapter a request's `model` names, load/unload, the run-time registry."""
