"""Workloads of the KV offloading benchmark (`benchmarks/kv/offloading.py`).

Multi-turn chats over a shared document, on a pool sized to hold the document and about two
conversations, visited round robin so that each revisit finds its own history evicted from the
pool; and distinct long prompts, computed once and sent again after a restart.

All prompts are token ids, so every length and block boundary is exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.harness.common import exact_length_prompt, make_text
from core_engine.common.math_utils import cdiv

Encode = Callable[[str], list[int]]
NULL_BLOCKS = 1  # block 0 of the pool is reserved, never cached
CONVERSATIONS_HELD = 2  # the pool holds the document and this many conversations at their longest


@dataclass(frozen=True, slots=True)
class ChatShape:
    """The sizes of a chat workload, in conversations, visits and tokens."""

    num_conversations: int
    num_visits: int
    document_tokens: int
    opening_tokens: int
    user_tokens: int
    max_tokens: int
    block_size: int = 16

    def __post_init__(self) -> None:
        _at_least("num_conversations", self.num_conversations, CONVERSATIONS_HELD + 1)
        _at_least("num_visits", self.num_visits, 2)
        for name in ("document_tokens", "opening_tokens", "user_tokens", "max_tokens"):
            _at_least(name, getattr(self, name), 1)
        _at_least("opening_tokens", self.opening_tokens, self.block_size)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What the client says in every conversation; the replies come from the server.

    Visit 0 of conversation c sends `document + openings[c]`; visit k >= 1 sends what visit
    k - 1 sent, then the reply it got (at most `max_tokens` tokens), then
    `user_messages[c][k - 1]`. Every conversation's visit k comes before any visit k + 1.
    No two openings share their first `block_size` tokens, so after the document's full blocks
    no block is shared between conversations.
    """

    document: list[int]
    openings: list[list[int]]
    user_messages: list[list[list[int]]]
    max_tokens: int
    block_size: int

    @property
    def num_conversations(self) -> int:
        return len(self.openings)

    @property
    def num_visits(self) -> int:
        return 1 + len(self.user_messages[0])

    @property
    def num_shared_blocks(self) -> int:
        """Full blocks of the document: the only blocks two conversations share."""
        return len(self.document) // self.block_size

    def visit_order(self) -> list[tuple[int, int]]:
        """(conversation, visit) pairs in the order they are sent: round robin."""
        return [(c, k) for k in range(self.num_visits) for c in range(self.num_conversations)]

    def prompt_tokens_bounds(self, conversation: int, visit: int) -> tuple[int, int]:
        """Fewest and most tokens of that visit's prompt: every earlier reply empty, or every
        earlier reply `max_tokens` long."""
        fewest = len(self.document) + len(self.openings[conversation])
        fewest += sum(len(message) for message in self.user_messages[conversation][:visit])
        return fewest, fewest + visit * self.max_tokens


def build_chat_plan(encode: Encode, shape: ChatShape, seed: int) -> ChatPlan:
    """A seeded chat plan of `shape`: synthetic English cut to exact token counts."""
    rng = random.Random(seed)
    document = exact_length_prompt(rng, encode, shape.document_tokens)
    openings: list[list[int]] = []
    opening_starts: set[tuple[int, ...]] = set()
    while len(openings) < shape.num_conversations:
        opening = exact_length_prompt(rng, encode, shape.opening_tokens)
        start = tuple(opening[: shape.block_size])
        if start not in opening_starts:
            opening_starts.add(start)
            openings.append(opening)
    user_messages = [
        [exact_length_prompt(rng, encode, shape.user_tokens) for _ in range(shape.num_visits - 1)]
        for _ in range(shape.num_conversations)
    ]
    return ChatPlan(document, openings, user_messages, shape.max_tokens, shape.block_size)


class ChatSession:
    """The prompts of a chat plan as a client builds them, reply by reply.

    Invariant: `histories[c]` is the last prompt of conversation c plus its reply, if added.
    """

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.histories: list[list[int]] = [[] for _ in range(plan.num_conversations)]
        self.num_visits_made = [0] * plan.num_conversations

    def next_prompt(self, conversation: int) -> list[int]:
        """The prompt of this conversation's next visit (its history plus the new message)."""
        visit = self.num_visits_made[conversation]
        if visit >= self.plan.num_visits:
            raise ValueError(
                f"conversation {conversation} has made all {self.plan.num_visits} visits"
            )
        if visit == 0:
            self.histories[conversation] = self.plan.document + self.plan.openings[conversation]
        else:
            self.histories[conversation] += self.plan.user_messages[conversation][visit - 1]
        self.num_visits_made[conversation] += 1
        return list(self.histories[conversation])

    def add_reply(self, conversation: int, reply_token_ids: list[int]) -> None:
        """Appends the reply to the conversation's last prompt."""
        if len(reply_token_ids) > self.plan.max_tokens:
            raise ValueError(
                f"a reply of {len(reply_token_ids)} tokens is longer than max_tokens="
                f"{self.plan.max_tokens}"
            )
        self.histories[conversation] += reply_token_ids


@dataclass(frozen=True, slots=True)
class ChatPoolSize:
    """A pool (`--num-gpu-blocks-override`) for a chat plan: the null block, the document's
    full blocks and CONVERSATIONS_HELD conversations at their longest.

    `min_blocks_between_visits` is the fewest blocks beyond the document's that the other
    conversations' requests hold, all told, between two visits of one conversation (each
    request a distinct conversation, so distinct blocks). When it exceeds
    `num_blocks_beyond_document`, more distinct blocks are used between the two visits than
    the pool caches beside the document, so the least recently used conversation, the one
    revisited, has lost its blocks: `evicts_between_visits`.
    """

    num_gpu_blocks: int
    num_shared_blocks: int
    max_own_blocks: int
    min_blocks_between_visits: int
    block_size: int
    max_model_len: int

    @property
    def num_blocks_beyond_document(self) -> int:
        return self.num_gpu_blocks - NULL_BLOCKS - self.num_shared_blocks

    @property
    def evicts_between_visits(self) -> bool:
        return self.min_blocks_between_visits > self.num_blocks_beyond_document


def chat_pool_size(plan: ChatPlan) -> ChatPoolSize:
    """The pool for `plan`; raises ValueError if it would keep a conversation between visits."""
    block_size, shared = plan.block_size, plan.num_shared_blocks
    longest = max(
        plan.prompt_tokens_bounds(c, plan.num_visits - 1)[1] + plan.max_tokens
        for c in range(plan.num_conversations)
    )
    max_own_blocks = cdiv(longest, block_size) - shared
    size = ChatPoolSize(
        num_gpu_blocks=NULL_BLOCKS + shared + CONVERSATIONS_HELD * max_own_blocks,
        num_shared_blocks=shared,
        max_own_blocks=max_own_blocks,
        min_blocks_between_visits=_min_blocks_between_visits(plan),
        block_size=block_size,
        max_model_len=cdiv(longest, block_size) * block_size,
    )
    if not size.evicts_between_visits:
        raise ValueError(
            f"a pool of {size.num_gpu_blocks} blocks keeps a conversation between its visits "
            f"(the others hold at least {size.min_blocks_between_visits} blocks beyond the "
            f"document, at most {size.num_blocks_beyond_document} are cached): use more "
            "conversations, longer openings or fewer visits"
        )
    return size


def _min_blocks_between_visits(plan: ChatPlan) -> int:
    """Over every two consecutive visits of one conversation, the fewest blocks beyond the
    document that the requests sent between them hold (every reply taken as empty)."""
    own_blocks = [
        cdiv(plan.prompt_tokens_bounds(c, k)[0], plan.block_size) - plan.num_shared_blocks
        for c, k in plan.visit_order()
    ]
    # Round robin: the next visit of the request at `index` is at index + num_conversations.
    num_between = plan.num_conversations - 1
    num_with_a_next_visit = len(own_blocks) - plan.num_conversations
    return min(
        sum(own_blocks[index + 1 : index + 1 + num_between])
        for index in range(num_with_a_next_visit)
    )


def long_prompts(encode: Encode, num_prompts: int, num_tokens: int, block_size: int, seed: int):
    """`num_prompts` distinct prompts of exactly `num_tokens` tokens, no two sharing their first
    block (so none can hit another's blocks)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    starts: set[tuple[int, ...]] = set()
    while len(prompts) < num_prompts:
        prompt = exact_length_prompt(rng, encode, num_tokens)
        if tuple(prompt[:block_size]) not in starts:
            starts.add(tuple(prompt[:block_size]))
            prompts.append(prompt)
    return prompts


def warm_up_prompt(encode: Encode, label: str) -> list[int]:
    """A short prompt seeded by `label`, apart from every workload's (other seeds, no shared
    document), to send each server before measuring."""
    return encode(make_text(random.Random(f"warm-up-{label}"), 30))


def _at_least(name: str, value: int, least: int) -> None:
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")


def restart_pool_size(
    prompts: list[list[int]], max_tokens: int, block_size: int
) -> tuple[int, int]:
    """(num_gpu_blocks, max_model_len) for a pool that holds every prompt with its output at
    once, beside the null block: nothing of them is evicted within one server's run."""
    num_blocks = [cdiv(len(prompt) + max_tokens, block_size) for prompt in prompts]
    return NULL_BLOCKS + sum(num_blocks), max(num_blocks) * block_size
