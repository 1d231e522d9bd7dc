"""Test helpers: tiny random models, the Serve fixtures, SSE parsing, engine runs."""
