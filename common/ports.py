"""Free TCP ports on this host, for rendezvous addresses and servers started by the engine,
its benchmarks and its tests."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
