"""The speculative-decoding benchmark's workloads, as token ids every side receives unchanged.

- copy-heavy chat: `copy_heavy_chats.COPY_HEAVY_TASKS` rendered with the model's chat template;
  greedy replies end where the model ends them (eos) or at `max_tokens`;
- random: seeded sentences of random common words (`bench_common.make_text`), every request
  generating exactly `max_tokens` tokens (ignore_eos); drafting finds little to copy there.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.harness.common import word_prompts
from benchmarks.spec_decode.copy_heavy_chats import Message, copy_heavy_conversations

CHAT = "copy-heavy-chat"
RANDOM = "random"
WORKLOAD_NAMES = (CHAT, RANDOM)


@dataclass(slots=True, frozen=True)
class DecodeWorkload:
    """Prompts sharing one `max_tokens`; with `ignore_eos` every request runs to it."""

    name: str
    description: str
    prompt_token_ids: list[list[int]]
    max_tokens: int
    ignore_eos: bool

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_token_ids)

    def to_json(self) -> dict:
        """What a peer runner needs to run it (see `benchmarks/peers/vllm_spec_decode_runner.py`)."""
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(slots=True, frozen=True)
class WorkloadShape:
    """How big each workload is; `--quick` shrinks every dimension."""

    chats_per_task: int
    chat_max_tokens: int
    num_random: int
    random_words: tuple[int, int]
    random_max_tokens: int


FULL_SHAPE = WorkloadShape(4, 192, 64, (20, 200), 128)
QUICK_SHAPE = WorkloadShape(1, 24, 8, (5, 30), 24)


def chat_workload(
    render: Callable[[list[Message]], list[int]], chats_per_task: int, max_tokens: int
) -> DecodeWorkload:
    """The copy-heavy chats, each rendered to token ids by `render` (the chat template with
    the generation prompt)."""
    conversations = copy_heavy_conversations(chats_per_task)
    num_tasks = len({task for task, _ in conversations})
    return DecodeWorkload(
        CHAT,
        f"{len(conversations)} chats ({num_tasks} tasks: rename, sort, SQL, JSON, spelling, "
        f"quote, table, CSV), up to {max_tokens} tokens, eos ends a reply",
        [render(conversation) for _, conversation in conversations],
        max_tokens,
        ignore_eos=False,
    )


def random_workload(
    encode: Callable[[str], list[int]], shape: WorkloadShape, seed: int
) -> DecodeWorkload:
    """Seeded random-word prompts, each generating exactly `random_max_tokens` tokens."""
    rng = random.Random(f"{seed}-{RANDOM}")
    texts = word_prompts(rng, shape.num_random, *shape.random_words)
    low, high = shape.random_words
    return DecodeWorkload(
        RANDOM,
        f"{shape.num_random} prompts of {low}-{high} random words, {shape.random_max_tokens} "
        "tokens each (ignore_eos)",
        [encode(text) for text in texts],
        shape.random_max_tokens,
        ignore_eos=True,
    )


def build_workloads(
    names: list[str],
    shape: WorkloadShape,
    render: Callable[[list[Message]], list[int]],
    encode: Callable[[str], list[int]],
    seed: int,
) -> list[DecodeWorkload]:
    """The workloads of `names`, in that order."""
    builders = {
        CHAT: lambda: chat_workload(render, shape.chats_per_task, shape.chat_max_tokens),
        RANDOM: lambda: random_workload(encode, shape, seed),
    }
    return [builders[name]() for name in names]


def num_prompts_for(
    num_prompts: int, concurrency: int | None, min_prompts: int, rounds: int
) -> int:
    """How many of a workload's prompts one run sends: all of them at saturation (concurrency
    None), else enough for `rounds` batches of `concurrency` and at least `min_prompts`, at
    most all."""
    if concurrency is None:
        return num_prompts
    return min(num_prompts, max(min_prompts, rounds * concurrency))
