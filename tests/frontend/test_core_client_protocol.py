"""Both core clients offer every member of the `CoreClient` protocol the engine client uses."""

from __future__ import annotations

import inspect

import pytest

from core_engine.frontend.core_client import AsyncCoreClient
from core_engine.frontend.core_client_protocol import CoreClient
from core_engine.frontend.data_parallel_client import DataParallelCoreClient

PROTOCOL_METHODS = sorted(
    name
    for name, member in vars(CoreClient).items()
    if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
)


@pytest.mark.parametrize("client_class", [AsyncCoreClient, DataParallelCoreClient])
def test_core_clients_implement_the_protocol(client_class):
    assert "get_stats_per_core" in PROTOCOL_METHODS
    for name in PROTOCOL_METHODS:
        expected = getattr(CoreClient, name)
        actual = getattr(client_class, name, None)
        assert actual is not None, f"{client_class.__name__} lacks {name}"
        if isinstance(expected, property):
            assert isinstance(actual, property), name
        else:
            assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected)
            assert list(inspect.signature(actual).parameters) == list(
                inspect.signature(expected).parameters
            ), name
