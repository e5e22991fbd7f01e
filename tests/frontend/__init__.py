"""Tests of `frontend/` in process: outputs and detokenizing, tokenizers, the OpenAI protocol
and error bodies, tool calls, the prefix router, the command line, metrics."""
