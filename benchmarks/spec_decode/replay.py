"""Replays n-gram drafters over recorded greedy replies: how many tokens each verified step
would keep, and the speed-up that gives under a step-cost model, without running the model.

The copy-heavy chats' greedy replies are generated once (the engine, no speculation); then for
each drafter every reply is re-walked step by step as the engine would: the drafter proposes
from the prompt and the reply so far, the drafts matching the reply's next tokens are kept plus
one token (the bonus, or the model's own where a draft failed). Greedy verification keeps
exactly that, so tokens per step are what the engine would get; seconds come from the cost
model `step_ms + per_draft_ms * drafts` (measure both with `bench_spec_decode` at batch 1:
no drafts gives `step_ms`).

    python -m benchmarks.spec_decode.replay [--num-chats 8] [--step-ms 46 --per-draft-ms 2.5]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core_engine.core.spec_decode.draft_length import AdaptiveDraftLength
from core_engine.core.spec_decode.ngram_proposer import NgramIndex

Propose = Callable[[list[int], int], list[int]]


@dataclass(slots=True, frozen=True)
class DrafterSpec:
    """An n-gram drafter: window, most drafts per step, and whether its length adapts."""

    min_n: int
    max_n: int
    max_drafts: int
    adaptive: bool

    @property
    def label(self) -> str:
        kind = "adaptive" if self.adaptive else "fixed"
        return f"n-gram {self.min_n}-{self.max_n}, K {self.max_drafts}, {kind}"


@dataclass(slots=True)
class ReplayTotals:
    num_steps: int = 0
    num_tokens: int = 0  # decoded after the first token (which the prefill step samples)
    num_drafts: int = 0

    def speedup(self, step_ms: float, per_draft_ms: float) -> float:
        """Time without drafts (a step per token) over the time with them."""
        with_drafts = self.num_steps * step_ms + self.num_drafts * per_draft_ms
        return self.num_tokens * step_ms / with_drafts if with_drafts else 1.0


def replay_reply(prompt: Sequence[int], reply: Sequence[int], spec: DrafterSpec, totals) -> None:
    """Walks one reply as the engine would with `spec`'s drafts; adds to `totals`."""
    index = NgramIndex(spec.min_n, spec.max_n)
    lengths = AdaptiveDraftLength(spec.max_drafts)
    tokens = [*prompt, *reply[:1]]
    position = 1
    while position < len(reply):
        limit = lengths.length("r") if spec.adaptive else spec.max_drafts
        drafts = index.propose(tokens, min(limit, len(reply) - position - 1))
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == reply[position + num_accepted]:
            num_accepted += 1
        kept = reply[position : position + num_accepted + 1]
        tokens += kept
        position += len(kept)
        lengths.observe("r", len(drafts), num_accepted)
        totals.num_steps += 1
        totals.num_tokens += len(kept)
        totals.num_drafts += len(drafts)


def replay(pairs, spec: DrafterSpec) -> ReplayTotals:
    totals = ReplayTotals()
    for prompt, reply in pairs:
        replay_reply(prompt, reply, spec, totals)
    return totals


DRAFTERS = [
    DrafterSpec(min_n, max_n, k, adaptive)
    for (min_n, max_n) in ((1, 5), (2, 4), (2, 5), (2, 8))
    for k in (4, 8, 16, 24)
    for adaptive in (False, True)
]


def greedy_replies(num_chats: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy reply) of the first `num_chats` copy-heavy chats, default model."""
    from benchmarks.spec_decode.copy_heavy_chats import copy_heavy_conversations
    from core_engine.core.in_process_engine import InProcessEngine
    from core_engine.frontend.async_engine_client import load_engine_tokenizer
    from core_engine.proto import SamplingParams
    from core_engine.proto.engine_config import EngineConfig
    from core_engine.worker.local_executor import LocalExecutor

    config = EngineConfig()
    tokenizer = load_engine_tokenizer(config)
    chats = copy_heavy_conversations(4)[:num_chats]
    prompts = [render(tokenizer, chat) for _, chat in chats]
    engine = InProcessEngine(config, LocalExecutor(config))
    output = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(p, list(r.token_ids)) for p, r in zip(prompts, output.results, strict=True)]


def render(tokenizer, conversation) -> list[int]:
    """The conversation's token ids with the chat template, as the server renders it."""
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    if isinstance(rendered, str):  # the template spells out the special tokens itself
        return tokenizer.encode(rendered, add_special_tokens=False)
    return list(rendered)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-chats", type=int, default=32, help="the first N chats (max 32)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--step-ms", type=float, default=46.0)
    parser.add_argument("--per-draft-ms", type=float, default=2.5)
    args = parser.parse_args(argv)
    if not 1 <= args.num_chats <= 32:
        parser.error(f"--num-chats must be in [1, 32], got {args.num_chats}")
    pairs = greedy_replies(args.num_chats, args.max_tokens)
    print(f"{args.num_chats} chats, {sum(len(r) for _, r in pairs)} reply tokens; cost model "
          f"{args.step_ms} ms per step + {args.per_draft_ms} ms per draft")  # fmt: skip
    print("| drafter | tokens per step | speed-up |\n|:---|---:|---:|")
    for spec in DRAFTERS:
        totals = replay(pairs, spec)
        speedup = totals.speedup(args.step_ms, args.per_draft_ms)
        print(f"| {spec.label} | {totals.num_tokens / totals.num_steps:.2f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
