"""The continuous-batching engine: sequences, scheduling, KV blocks, and the step loop."""
