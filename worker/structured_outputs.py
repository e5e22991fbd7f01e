"""`StructuredOutputManager`: each constrained request's grammar matcher, where the logits are.

A grammar is compiled against the model's vocabulary on a background thread, and a request
waits outside the batch while it compiles, so a slow schema (seconds for a large one) stalls
only its own request. The scheduler keeps a new constrained request in WAITING_FOR_FSM, holding
no blocks, and sends its constraint once in `SchedulerOutput.grammars_to_prepare`; every rank
starts the compile without waiting (`add_request`; compiled grammars are cached by constraint,
so a repeated schema costs nothing) and, after each step, reports the compiles that finished
(`take_compiled`: `ModelRunnerOutput.grammars_ready`, or a request error naming the problem).
The scheduler admits a request only after that report. A step with no tokens while grammars
compile (the only requests are waiting for theirs) is answered when one finishes or after
`wait_for_compile`'s short timeout, so an idle engine core learns of readiness without spinning.

Why the worker compiles, not the frontend: the compiled grammar is built from the worker's own
vocabulary and never crosses a process boundary (xgrammar 0.2 can serialize one, but as JSON of
up to megabytes: 1.8 MB for a two-field schema on SmolLM2's vocabulary, to send to every rank
with the request), a raw client that bypasses the frontend's check is still served, and
`core/` stays free of xgrammar, which loads torch.
With tensor parallelism rank 0's report is the one the scheduler acts on, so every rank follows
the same decision: a rank whose own compile is still running when the request is scheduled
waits for it in that step (they started together), and a request that fails on rank 0 is
finished everywhere through `finished_req_ids`.

When the request samples, its matcher fills one row of a token bitmask and the logits of every
disallowed token become -inf, for all constrained rows of the step at once. The matcher
advances with the tokens the scheduler sends back (`CachedRequestData.new_token_ids`), which
are the tokens every rank holds, so every tensor-parallel rank masks alike.

A request verifying draft tokens (speculative decoding) gets one masked row per verified
position: the matcher advances through the drafts while the grammar accepts them, masks each
position, and is rolled back over them at once, so that it still advances only with the tokens
the scheduler sends back (which may be fewer than the worker returned: a stop inside the
accepted run). A draft the grammar refuses is masked out where it stands, so it is rejected.

Once the grammar is complete only the model's eos ids are allowed. A matcher that refuses a token
(which masking prevents; a logit bias of -100 on every allowed token is one way to force it) stops
constraining that request, with a warning, instead of failing the step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core_engine.common.gguf_file import GGUFFile
from core_engine.common.grammars import build_grammar, xgrammar
from core_engine.common.json_file import read_json
from core_engine.common.model_files import TOKENIZER_FILE_NAME, is_gguf_file
from core_engine.proto.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
GGUF_VOCAB_TYPES = {"gpt2": "BYTE_LEVEL", "llama": "BYTE_FALLBACK"}


@dataclass(slots=True)
class ConstrainedRequest:
    """`matcher` is None until the compiled grammar is there; tokens that arrive before that
    wait in `pending_token_ids`."""

    compiled: Future
    matcher: Any = None
    pending_token_ids: list[int] = field(default_factory=list)


class StructuredOutputManager:
    """Grammar matchers of one worker's constrained requests; not thread-safe (the step's thread).

    Invariant: every request not yet reported by `take_compiled` is in `requests` (it leaves
    both through `remove_request`).

    The tokenizer description xgrammar needs is read from the model files on the first
    constrained request, so an engine that never sees one never imports xgrammar.
    """

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.requests: dict[str, ConstrainedRequest] = {}
        # Requests whose compile the scheduler has not been told about yet (see take_compiled).
        self._unreported_req_ids: set[str] = set()
        self._compiler: Any = None
        self._cache: OrderedDict[bytes, Future] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def add_request(self, req_id: str, constraint: StructuredOutputs) -> None:
        """Starts compiling `constraint` (or reuses its cached grammar) for a new request, and
        returns at once; `take_compiled` reports it once the compile is over."""
        self.requests[req_id] = ConstrainedRequest(self._compiled(constraint))
        self._unreported_req_ids.add(req_id)

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._unreported_req_ids.discard(req_id)

    @property
    def has_compiles_to_report(self) -> bool:
        return bool(self._unreported_req_ids)

    def take_compiled(self) -> tuple[list[str], dict[str, str]]:
        """The requests whose compile finished since the last call: the ids that compiled, and
        the ids that failed with the reason (those are dropped here). Never waits."""
        ready_req_ids: list[str] = []
        errors: dict[str, str] = {}
        for req_id in sorted(self._unreported_req_ids):
            compiled = self.requests[req_id].compiled
            if not compiled.done():
                continue
            self._unreported_req_ids.discard(req_id)
            exc = compiled.exception()
            if exc is None:
                ready_req_ids.append(req_id)
            else:  # a bad constraint from a raw client: fail that request
                errors[req_id] = f"structured_outputs: {exc}"
                self.remove_request(req_id)
        return ready_req_ids, errors

    def wait_for_compile(self, timeout_s: float) -> None:
        """Returns when a compile not yet reported is over, or after `timeout_s`."""
        futures = [self.requests[r].compiled for r in self._unreported_req_ids]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Advances the request's matcher over tokens the scheduler kept for it."""
        request = self.requests.get(req_id)
        if request is None or not token_ids:
            return
        if request.matcher is None:
            request.pending_token_ids.extend(token_ids)
            return
        for token_id in token_ids:
            if request.matcher.is_terminated():
                return  # eos under ignore_eos: nothing left to constrain
            if not request.matcher.accept_token(token_id):
                logger.warning(
                    "request %r: token %d breaks its grammar; the rest of it is unconstrained",
                    req_id,
                    token_id,
                )
                self.remove_request(req_id)
                return

    def mask_logits(
        self,
        logits: torch.Tensor,
        req_ids: Sequence[str],
        draft_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, str]:
        """Sets to -inf, in place, every logit the grammar of a constrained request forbids;
        rows of unconstrained requests are left alone. Request i (`req_ids[i]`) owns
        1 + len(draft_token_ids[i]) consecutive rows (one without drafts): row j is masked by
        its grammar's state after drafts d_1..d_j (see `_fill_draft_rows`), and the matcher
        ends where it began. Returns the requests whose grammar did not compile, with the
        reason (they are dropped here; their rows are not masked, and the caller reports them
        so that the scheduler fails them)."""
        if draft_token_ids is None:
            draft_token_ids = [()] * len(req_ids)
        errors: dict[str, str] = {}
        row_starts, num_rows, constrained = [], 0, []
        for i, req_id in enumerate(req_ids):
            row_starts.append(num_rows)
            num_rows += 1 + len(draft_token_ids[i])
            if req_id not in self.requests:
                continue
            try:
                self._ensure_matcher(req_id)
            except Exception as exc:  # a bad constraint from a raw client: fail that request
                errors[req_id] = f"structured_outputs: {exc}"
                self.remove_request(req_id)
                continue
            if req_id in self.requests:  # still constrained after replaying its tokens
                constrained.append(i)
        if constrained:
            xgr = xgrammar()
            bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
            rows: list[int] = []
            for i in constrained:
                matcher = self.requests[req_ids[i]].matcher
                rows += _fill_draft_rows(matcher, bitmask, row_starts[i], draft_token_ids[i])
            if rows:
                xgr.apply_token_bitmask_inplace(
                    logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows
                )
        return errors

    def _ensure_matcher(self, req_id: str) -> None:
        """Makes the request's matcher on first use, waiting for its grammar if need be (a rank
        whose compile lags rank 0's), and replays the tokens that arrived before it."""
        request = self.requests[req_id]
        if request.matcher is None:
            request.matcher = xgrammar().GrammarMatcher(request.compiled.result())
            pending, request.pending_token_ids = request.pending_token_ids, []
            self.accept_tokens(req_id, pending)

    def _compiled(self, constraint: StructuredOutputs) -> Future:
        key = constraint.cache_key
        future = self._cache.get(key)
        if future is None:
            future = self._executor.submit(self._compile, constraint)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _compile(self, constraint: StructuredOutputs) -> Any:
        grammar = build_grammar(**constraint.grammar_spec())
        if self._compiler is None:
            xgr = xgrammar()
            self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=1)
        return self._compiler.compile_grammar(grammar)

    def _tokenizer_info(self, xgr: Any) -> Any:
        """xgrammar's view of the vocabulary: every token's text as the tokenizer stores it."""
        if is_gguf_file(self.model_path):
            gguf = GGUFFile(self.model_path)
            vocab_type = GGUF_VOCAB_TYPES.get(gguf.field("tokenizer.ggml.model"), "RAW")
            return xgr.TokenizerInfo(
                gguf.field("tokenizer.ggml.tokens"),
                getattr(xgr.VocabType, vocab_type),
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids,
            )
        tokenizer_json = read_json(self.model_path / TOKENIZER_FILE_NAME)
        # {"vocab_type": VocabType, "add_prefix_space": bool} (an enum: not JSON metadata)
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(
            (self.model_path / TOKENIZER_FILE_NAME).read_text(encoding="utf-8")
        )
        return xgr.TokenizerInfo(
            _encoded_vocab(tokenizer_json, self.vocab_size),
            metadata["vocab_type"],
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_token_ids,
            add_prefix_space=metadata["add_prefix_space"],
        )


def _fill_draft_rows(
    matcher: Any, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int]
) -> list[int]:
    """Fills `bitmask` row `first_row + j` with the matcher's mask after drafts d_1..d_j, for as
    long as the grammar accepts the drafts, then rolls the matcher back over the drafts it
    accepted. Returns the rows filled. A draft the grammar refuses is masked out at its own row,
    so it is rejected there and the rows after it are never used: they are left unmasked. So
    are rows after the grammar has terminated (an eos under ignore_eos): nothing is left to
    constrain, and xgrammar has no mask to give."""
    rows = []
    num_advanced = 0
    for j in range(len(draft_token_ids) + 1):
        if matcher.is_terminated():
            break
        rows.append(first_row + j)
        matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if j == len(draft_token_ids) or not matcher.accept_token(draft_token_ids[j]):
            break
        num_advanced += 1
    if num_advanced:
        matcher.rollback(num_advanced)
    return rows


def _encoded_vocab(tokenizer_json: dict, vocab_size: int) -> list[str]:
    """Token texts by id from tokenizer.json (model vocabulary, then added tokens); ids with no
    token (a padded embedding) get an empty string, which no grammar can use."""
    vocab = [""] * vocab_size
    model_vocab = tokenizer_json.get("model", {}).get("vocab", {})
    items = (
        model_vocab.items()
        if isinstance(model_vocab, dict)
        else ((entry[0], i) for i, entry in enumerate(model_vocab))
    )
    for token, token_id in items:
        if token_id < vocab_size:
            vocab[token_id] = token
    for added in tokenizer_json.get("added_tokens", []):
        if added["id"] < vocab_size:
            vocab[added["id"]] = added["content"]
    return vocab
