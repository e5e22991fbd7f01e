"""`ConfigError`: a setting the engine cannot run with, found once the model or the machine is
known."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting the engine cannot run with: a tensor_parallel_size that does not divide the
    model's heads, a max_model_len past the model's context, a KV cache too small for one
    request. Its message names the setting and its value and says what would work.

    Contract: it is the user's to fix, not a bug, so it travels from the process that found it
    (a worker, the core) to the one closest to the user as text marked as a config error, and is
    reported there once, in one line, without a traceback: `LLM(...)` raises it, core-serve
    exits with code 2 as for a bad flag.
    """
