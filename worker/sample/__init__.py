"""Sampling the next tokens from logits: the `Sampler` (greedy, temperature, top-k/top-p/min-p,
penalties, logprobs, per-request seeds through `inverse_cdf.py`) and the `RejectionSampler`
that verifies draft tokens."""
