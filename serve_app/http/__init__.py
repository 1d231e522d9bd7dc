"""HTTP plumbing of the ingress: body limits, errors, SSE, API keys, metrics."""
