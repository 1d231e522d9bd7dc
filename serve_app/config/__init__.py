"""The application config (the Serve YAML's `args`): typed, validated at start, read by every other package."""
