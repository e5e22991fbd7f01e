"""Speculative decoding, the engine core's half: draft proposers (n-gram prompt lookup and
suffix decoding), the `Drafter` that picks one and applies the limits, and the counters of
drafts proposed and accepted. Torch-free: the core has every request's tokens, so drafting
needs nothing from the workers, and with tensor parallelism no rank repeats it."""
