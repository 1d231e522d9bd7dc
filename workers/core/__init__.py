"""The worker's neutral core: sequences, a step's data, its events, the engine's limits; every other worker package imports it, it imports only workers.contract."""
