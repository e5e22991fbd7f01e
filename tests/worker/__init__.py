"""Tests of `worker/`: the worker and its model runner, batches and block tables, sampling,
model loading and parity with transformers, structured outputs, connectors' worker side."""
