"""chatserve HTTP side: the Ray Serve ingress, the OpenAI protocol and its dialects."""
