"""Media in requests, resolved by the ingress before the worker call: where image bytes may come from."""
