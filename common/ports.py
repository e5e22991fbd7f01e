"""Free TCP ports on this host, for rendezvous addresses and servers started by the engine,
its benchmarks and its tests."""

from __future__ import annotations

import contextlib
import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def find_free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P + 1 are both free on `host` right now: a `tcp://HOST:P`
    frontend address binds both (see `proto.endpoints`)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            with socket.socket() as second, contextlib.suppress(OSError):
                second.bind((host, port + 1))
                return port
    raise OSError(f"found no two consecutive free ports on {host} in 50 tries")
