"""Turning a batch's logits into tokens: the batched sampler, log-probabilities, grammar masks."""
