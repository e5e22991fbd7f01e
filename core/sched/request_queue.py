"""Waiting queues: first-come-first-served and priority."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from core_engine.core.request import Request


class FCFSRequestQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def add_request_in_arrival_order(self, request: Request) -> None:
        """Behind every queued request that arrived before it: a request that waited outside
        the queue (its grammar compiling) keeps the place its arrival gave it."""
        position = len(self._queue)
        while position > 0 and self._queue[position - 1].arrival_time > request.arrival_time:
            position -= 1
        self._queue.insert(position, request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(map(id, requests))
        self._queue = deque(r for r in self._queue if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest `priority` value first, then earliest arrival (Request.__lt__).

    A preempted request re-enters by its priority: the front of the queue is where that puts it
    among requests of its own priority, since it arrived before them.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request
    add_request_in_arrival_order = add_request  # the heap orders by priority, then arrival

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(map(id, requests))
        self._heap = [r for r in self._heap if id(r) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; choose 'fcfs' or 'priority'")
