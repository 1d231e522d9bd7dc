"""The request dialects the ingress speaks, one module (or package) each, and what they share."""
