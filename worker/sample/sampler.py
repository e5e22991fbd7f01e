"""Token sampling over a batch: logit bias, penalties, greedy, temperature, min-p, top-k, top-p,
seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core_engine.kernels.cpu import softmax_sample as cpu_softmax_sample
from core_engine.proto import TokenLogprobs
from core_engine.worker.sample.inverse_cdf import sample_inverse_cdf


@dataclass(slots=True)
class RowPenalties:
    """One row's penalties, as OpenAI and vLLM define them: `frequency` times how often a token
    was generated and `presence` once if it was are subtracted from its logit; a token seen in
    the prompt or the output has a positive logit divided by `repetition`, a negative one
    multiplied by it."""

    presence: float
    frequency: float
    repetition: float
    prompt_token_ids: torch.Tensor  # int64 [P], on the logits' device
    output_token_ids: torch.Tensor  # int64 [O]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the N rows of a logits tensor, all on the logits' device.

    `temperature` float32 [N] (0 = greedy), `top_k` int64 [N] (0 = off), `top_p` float32 [N]
    (1 = off), `min_p` float32 [N] (0 = off). `generators[i]` is row i's own generator when its
    request has a seed: a seeded row's draws depend only on that generator and that row's logits.
    `num_logprobs[i]` is the number of top logprobs row i wants, or None for no logprobs.
    `banned_token_ids[i]` lists tokens row i must not sample this step (eos before min_tokens).
    `logit_bias[i]` is (token ids, biases) added to row i's logits; `penalties[i]` row i's
    presence, frequency and repetition penalties with its prompt and output tokens so far.
    `flags`: which of those the rows use, read on the host where the rows were gathered (None:
    read from the tensors, which makes the host wait for the device).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    num_logprobs: list[int | None] = field(default_factory=list)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logit_bias: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    penalties: dict[int, RowPenalties] = field(default_factory=dict)
    flags: SamplingFlags | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    def get_flags(self) -> SamplingFlags:
        if self.flags is None:
            self.flags = SamplingFlags.of(
                self.temperature.cpu().numpy(),
                self.top_k.cpu().numpy(),
                self.top_p.cpu().numpy(),
                self.min_p.cpu().numpy(),
            )
        return self.flags


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """What a step's rows ask of the sampler, as host booleans: the sampler branches on these
    without reading the device."""

    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @staticmethod
    def of(
        temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
    ) -> SamplingFlags:
        greedy = temperature == 0.0
        return SamplingFlags(
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1.0).any()),
            any_min_p=bool((min_p > 0.0).any()),
        )


@dataclass(slots=True)
class SamplerOutput:
    """`sampled_token_ids` int64 [N]; `logprobs[i]` is set iff row i asked for logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row of float32 logits [N, vocab].

    Order of operations per row: logit bias added, penalties applied, banned tokens masked;
    greedy rows take the argmax; other rows divide by temperature, drop tokens below
    `min_p * max_prob`, keep the `top_k` most likely, keep the smallest prefix of those whose
    mass reaches `top_p`, then sample from what is left.
    Logprobs are `log_softmax` of the logits as given (before temperature and filters); rank is
    1 + the number of tokens with a strictly higher logprob.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self._device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = raw_logprobs_if_needed(logits, metadata)
        logits = apply_logits_processors(logits, metadata)
        flags = metadata.get_flags()
        if flags.all_greedy:
            sampled = greedy_token_ids(logits)
        else:
            sampled = self._random_tokens(logits, metadata)
            if flags.any_greedy:
                is_greedy = metadata.temperature == 0.0
                sampled = torch.where(is_greedy, greedy_token_ids(logits), sampled)
        logprobs = gather_logprobs(raw_logprobs, sampled, metadata.num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def random_sample(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """One token per row of `probs` [N, vocab] (non-negative, not necessarily normalised),
        drawn with probability proportional to its entry, from one uniform draw per row (see
        `inverse_cdf`). Row i draws from `generators[i]` when given, else from the sampler's
        own generator."""
        return sample_inverse_cdf(probs, self._row_uniforms(probs.shape[0], generators))

    def _random_tokens(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """`random_sample` of `target_probs`; on CPU logits with no min-p, top-k or top-p, the
        same draw in one C kernel from the logits and temperatures (softmax_sample.c)."""
        flags = metadata.get_flags()
        filtered = flags.any_min_p or flags.any_top_k or flags.any_top_p
        if filtered or not cpu_softmax_sample.supports(logits):
            return self.random_sample(target_probs(logits, metadata), metadata.generators)
        uniforms = self._row_uniforms(logits.shape[0], metadata.generators)
        temperature = torch.where(metadata.temperature == 0.0, 1.0, metadata.temperature)
        return cpu_softmax_sample.softmax_sample(logits, temperature, uniforms)

    def _row_uniforms(self, num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """float64 [num_rows] in [0, 1): row i's from `generators[i]` when given, else from
        the sampler's own generator."""
        uniforms = torch.rand(
            num_rows, generator=self._generator, device=self._device, dtype=torch.float64
        )
        for row, generator in generators.items():
            uniforms[row] = torch.rand(
                (), generator=generator, device=self._device, dtype=torch.float64
            )
        return uniforms

    def uniform(
        self, num_values: int, generator_spans: dict[tuple[int, int], torch.Generator]
    ) -> torch.Tensor:
        """float32 [num_values] uniform in [0, 1); values `start:end` of each span in
        `generator_spans` come from that span's generator, the others from the sampler's own."""
        u = torch.rand(num_values, generator=self._generator, device=self._device)
        for (start, end), generator in generator_spans.items():
            u[start:end] = torch.rand(end - start, generator=generator, device=self._device)
        return u


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """int64 [N]: each row's argmax (the first of equal largest values, a NaN counting as the
    largest, as torch.argmax). A CPU float32 batch goes through numpy's argmax: torch's takes
    ~60 us for one row of a 49k vocabulary, numpy's ~5 (a decode step of one user samples
    one such row per token)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """float32 logits with each row's logit bias added, penalties applied and banned tokens at
    -inf (a new tensor when anything changes; `logits` itself is never written). Greedy rows
    take the argmax of this."""
    if metadata.logit_bias or metadata.penalties:
        logits = logits.clone()
        _add_logit_bias(logits, metadata.logit_bias)
        _apply_penalties(logits, metadata.penalties)
    return _mask_banned(logits, metadata.banned_token_ids)


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from, given `apply_logits_processors`' output:
    softmax after temperature (greedy rows: 1), min-p, top-k and top-p."""
    temperature = torch.where(metadata.temperature == 0.0, 1.0, metadata.temperature)
    logits = logits / temperature[:, None]
    flags = metadata.get_flags()
    if flags.any_min_p:
        logits = _apply_min_p(logits, metadata.min_p)
    if flags.any_top_k or flags.any_top_p:
        logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, flags)
    return torch.softmax(logits, dim=-1)


def raw_logprobs_if_needed(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """log_softmax of the logits as given, when any row asked for logprobs."""
    if all(n is None for n in metadata.num_logprobs):
        return None
    return torch.log_softmax(logits, dim=-1)


def _add_logit_bias(
    logits: torch.Tensor, logit_bias: dict[int, tuple[list[int], list[float]]]
) -> None:
    for row, (token_ids, biases) in logit_bias.items():
        logits[row, token_ids] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _apply_penalties(logits: torch.Tensor, penalties: dict[int, RowPenalties]) -> None:
    """In place, for the penalized rows together: their token counts and seen-token masks are
    built with one scatter each over [rows, vocab], then every penalty is one tensor op. Rows
    that asked for none are not touched and cost nothing."""
    if not penalties:
        return
    vocab_size = logits.shape[-1]
    rows = torch.tensor(list(penalties), device=logits.device)
    values = list(penalties.values())

    def column(name: str) -> torch.Tensor:
        numbers = [getattr(penalty, name) for penalty in values]
        return torch.tensor(numbers, dtype=logits.dtype, device=logits.device)[:, None]

    output_counts = _token_counts([p.output_token_ids for p in values], vocab_size, logits)
    prompt_counts = _token_counts([p.prompt_token_ids for p in values], vocab_size, logits)
    penalized = logits[rows]
    repetition = column("repetition")
    seen = (output_counts + prompt_counts) > 0
    repeated = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
    penalized = torch.where(seen, repeated, penalized)
    penalized -= column("frequency") * output_counts + column("presence") * (output_counts > 0)
    logits[rows] = penalized


def _token_counts(
    token_ids: list[torch.Tensor], vocab_size: int, like: torch.Tensor
) -> torch.Tensor:
    """[rows, vocab] how often each token occurs in each row's list (a scatter of ones over the
    lists padded with an extra column, dropped after)."""
    length = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), length), vocab_size, dtype=torch.int64, device=like.device)
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = ids
    counts = torch.zeros((len(token_ids), vocab_size + 1), dtype=like.dtype, device=like.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=like.dtype))
    return counts[:, :vocab_size]


def _mask_banned(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> torch.Tensor:
    if not banned_token_ids:
        return logits
    logits = logits.clone()
    for row, token_ids in banned_token_ids.items():
        logits[row, token_ids] = float("-inf")
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below `min_p` times the row's highest probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, flags: SamplingFlags
) -> torch.Tensor:
    """Keeps each row's `top_k` best tokens (0 = all), then the smallest best-first prefix whose
    probability mass reaches `top_p`; the best token always survives. Ties break by sort order.
    `flags` says whether any row uses either."""
    use_top_k, use_top_p = flags.any_top_k, flags.any_top_p
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    if use_top_k:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp_max(vocab_size)
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if use_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor | None, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Row i's logprob and rank of `sampled[i]` and its `num_logprobs[i]` best alternatives,
    from `logprobs` [N, vocab]; None for rows that asked for none (all, when `logprobs` is)."""
    if logprobs is None:
        return [None] * int(sampled.shape[0])
    max_num = max(n for n in num_logprobs if n is not None)
    top_logprobs, top_ids = logprobs.topk(max_num, dim=-1) if max_num > 0 else (None, None)
    sampled_logprobs = logprobs.gather(-1, sampled[:, None])
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    sampled_logprobs_list = sampled_logprobs[:, 0].tolist()
    ranks_list = ranks.tolist()
    top_ids_list = top_ids.tolist() if top_ids is not None else None
    top_logprobs_list = top_logprobs.tolist() if top_logprobs is not None else None
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                sampled_logprob=sampled_logprobs_list[row],
                sampled_rank=ranks_list[row],
                top_token_ids=top_ids_list[row][:n] if n else [],
                top_logprobs=top_logprobs_list[row][:n] if n else [],
            )
        )
    return out
