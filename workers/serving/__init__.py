"""The Ray Serve model worker: the deployment, the engine thread behind asyncio, one request end to end."""
