"""`check_request_fits`: whether a request can run on an engine of a given vocabulary and
context window, checked once where each request is built (the frontend before it sends one,
the engine core for every request that arrives, the in-process engine)."""

from __future__ import annotations

from collections.abc import Sequence

from core_engine.proto.parameter_error import ParameterError
from core_engine.proto.sampling_params import SamplingParams


def check_request_fits(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    prompt_vocab_size: int | None = None,
) -> None:
    """ParameterError naming the field unless the request fits: a prompt of at least one token,
    every token id in [0, prompt_vocab_size) (default vocab_size; the frontend's is also
    bounded by what its tokenizer decodes), room in the context window for at least one
    generated token (`max_tokens` of them when given), and stop, biased and banned token ids
    the model can produce (below vocab_size)."""
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise ParameterError("prompt", "the prompt must not be empty")
    prompt_vocab = vocab_size if prompt_vocab_size is None else prompt_vocab_size
    lowest, highest = min(prompt_token_ids), max(prompt_token_ids)
    if lowest < 0 or highest >= prompt_vocab:
        outside = lowest if lowest < 0 else highest
        raise ParameterError(
            "prompt", f"prompt token id {outside} is outside the vocabulary [0, {prompt_vocab})"
        )
    if num_prompt_tokens >= max_model_len:
        raise ParameterError(
            "prompt",
            f"the prompt is {num_prompt_tokens} tokens long, but this model's maximum context "
            f"length is {max_model_len} tokens, which must leave room for at least one generated "
            "token",
        )
    max_tokens = params.max_tokens
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ParameterError(
            "max_tokens",
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
            f"prompt, max_tokens={max_tokens}); max_tokens may be at most "
            f"{max_model_len - num_prompt_tokens}",
        )
    params.check_vocabulary(vocab_size)
