"""C sources of the worker built on the host at first use (workers/native/build.py)."""
