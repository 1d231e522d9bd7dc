"""Tools outside the product: benchmarks (tools/bench) and reliability runs (tools/reliability)."""
