"""Per-request sampling and stopping parameters, validated on construction and on decode."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from core_engine.proto.kv_transfer_params import KVTransferParams
from core_engine.proto.parameter_error import ParameterError

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0
# Bounds that keep every field inside the worker's int64 sampling tensors and msgpack.
MAX_TOP_K = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


class StructuredOutputs(msgspec.Struct, omit_defaults=True, gc=False):
    """A constraint on a request's output; exactly one field is set. `json`: a JSON schema (as
    JSON text); `json_object`: any JSON object; `regex`; `choice`: one of these strings;
    `grammar`: an EBNF grammar (xgrammar's dialect, rule `root`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [
            name for name in self.__struct_fields__ if getattr(self, name) not in (None, False)
        ]
        if len(kinds) != 1:
            raise ParameterError(
                "structured_outputs",
                "structured_outputs must set exactly one of json, json_object, regex, choice and "
                f"grammar, got {kinds or 'none'}",
            )
        if self.choice is not None and not self.choice:
            raise ParameterError(
                "structured_outputs", "structured_outputs.choice must list at least one string"
            )

    def grammar_spec(self) -> dict[str, object]:
        """The keyword arguments of `common.grammars.build_grammar` for this constraint."""
        return {
            "json_schema": self.json,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "ebnf": self.grammar,
        }

    @property
    def cache_key(self) -> bytes:
        """Equal for equal constraints: what compiled grammars are cached by."""
        return msgspec.msgpack.encode(self)


class SamplingParams(msgspec.Struct, omit_defaults=True, gc=False):
    """How to sample one request and when to stop it.

    Contract: every instance that exists has passed `__post_init__`, whether it was built in
    Python or decoded off the wire (msgspec calls `__post_init__` after decoding and turns its
    `ValueError` into a `msgspec.ValidationError`). `top_k == 0` and `top_p == 1.0` and
    `min_p == 0.0` disable those filters; `temperature == 0.0` means greedy.
    `max_tokens=None` means "up to the model's context window".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    # The token sequences of bad_words (the frontend's tokenizer fills them in); a request's
    # next token is banned when it would complete one of them.
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # Mixed into the hash of the prompt's first KV block, so only requests with the same salt
    # share prefix-cache entries (one tenant cannot time another's prompts).
    cache_salt: str | None = None
    # Prefill/decode disaggregation (vLLM's field): ask a prefill instance to hold the
    # prompt's KV for a decode instance, or tell a decode instance where to pull it from.
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        # Messages are formatted only on failure: this runs in every process a request crosses.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_sampling()
        self._check_lengths_and_stops()
        self._check_seed_and_penalties()
        self._check_token_biases()
        self._check_logprobs_and_salt()

    def _check_sampling(self) -> None:
        if self.n < 1:
            raise ParameterError("n", f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0.0 or self.temperature == math.inf:  # NaN fails >=
            raise ParameterError(
                "temperature", f"temperature must be >= 0 and finite, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 and self.top_k != -1:
            raise ParameterError("top_k", f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.top_k > MAX_TOP_K:
            raise ParameterError("top_k", f"top_k must be at most {MAX_TOP_K}, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p}")

    def _check_lengths_and_stops(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
            )
        if self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if not all(self.stop):
            raise ParameterError("stop", "stop strings must not be empty")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise ParameterError(
                "stop_token_ids", f"stop_token_ids must be non-negative, got {self.stop_token_ids}"
            )

    def _check_seed_and_penalties(self) -> None:
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED - (self.n - 1):
            raise ParameterError(
                "seed",
                f"seed must be in [{MIN_SEED}, {MAX_SEED - (self.n - 1)}] (choice i of n uses "
                f"seed + i), got {self.seed}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
                raise ParameterError(
                    name, f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}"
                )
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ParameterError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                f"{self.repetition_penalty}",
            )

    def _check_token_biases(self) -> None:
        for token_id, bias in self.logit_bias.items():
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ParameterError(
                    "logit_bias",
                    f"logit_bias maps token ids >= 0 to biases in [-{MAX_LOGIT_BIAS}, "
                    f"{MAX_LOGIT_BIAS}], got {token_id}: {bias}",
                )
        if not all(word.strip() for word in self.bad_words):
            raise ParameterError("bad_words", "bad_words must not be empty or blank")
        if not all(self.bad_words_token_ids) or any(
            t < 0 for ids in self.bad_words_token_ids for t in ids
        ):
            raise ParameterError(
                "bad_words_token_ids",
                "bad_words_token_ids must be non-empty lists of token ids >= 0",
            )

    def _check_logprobs_and_salt(self) -> None:
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ParameterError(
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParameterError(
                "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.kv_transfer_params is not None and self.n != 1:
            raise ParameterError(
                "kv_transfer_params",
                f"kv_transfer_params hands over one sequence's KV: n must be 1, got {self.n}",
            )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ParameterError(
                "cache_salt",
                f"cache_salt must be a non-empty string when given, got {self.cache_salt!r}",
            )

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError for a stop or biased token id the model cannot produce; the engine checks
        this where it learns the vocabulary size (the engine core, and the frontend before
        sending)."""
        bad_word_ids = [t for ids in self.bad_words_token_ids for t in ids]
        for name, token_ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias),
            ("bad_words_token_ids", bad_word_ids),
        ):
            if token_ids and max(token_ids) >= vocab_size:
                raise ParameterError(
                    name,
                    f"{name} must name token ids below the vocabulary size {vocab_size}, got "
                    f"{max(token_ids)}",
                )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def stop_on_eos(
    params: SamplingParams, eos_token_ids: Sequence[int]
) -> tuple[int | None, SamplingParams]:
    """The model's eos rule for one request: (its eos id, its params). The first of the model's
    eos ids is the request's eos; the others join `stop_token_ids` unless `ignore_eos` (so a
    request stops on any of them, and `min_tokens` holds them all back)."""
    eos_token_id = eos_token_ids[0] if eos_token_ids else None
    if params.ignore_eos or len(eos_token_ids) < 2:
        return eos_token_id, params
    extra_stops = [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
    if not extra_stops:
        return eos_token_id, params
    stop_token_ids = [*params.stop_token_ids, *extra_stops]
    return eos_token_id, msgspec.structs.replace(params, stop_token_ids=stop_token_ids)
