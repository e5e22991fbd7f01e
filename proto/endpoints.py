"""How one frontend address names the two sockets of the frontend <-> engine core link.

The frontend binds, the core connects, and both derive the pair from the same single address, so
`python -m core_engine.core --frontend-address ADDR` and `AsyncCoreClient(config, ADDR)` always agree.
Also the one reading of a TCP address (`tcp://HOST:PORT`) for the links of workers on other
hosts (`parse_tcp_address`).
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

# The prefix of the 0700 directory a frontend makes for its own ipc sockets (mkdtemp).
PRIVATE_IPC_DIR_PREFIX = "core-engine-"
# A unix socket path fits in sockaddr_un.sun_path: 108 bytes with the terminating NUL.
MAX_IPC_PATH_BYTES = 107


class FrontendEndpoints(NamedTuple):
    requests: str
    """Frontend ROUTER <- core DEALER: requests, aborts, utility calls; the core's EngineReady."""
    outputs: str
    """Frontend PULL <- core PUSH: EngineCoreOutputs, UtilityResponse, EngineDead."""


def frontend_endpoints(address: str) -> FrontendEndpoints:
    """`tcp://HOST:PORT` -> PORT and PORT+1; `ipc://PATH` -> `PATH-requests`, `PATH-outputs`.

    Raises ValueError for any other scheme, a TCP address without an explicit port, or an ipc
    path too long for a unix socket.
    """
    if address.startswith("ipc://"):
        endpoints = FrontendEndpoints(f"{address}-requests", f"{address}-outputs")
        longest = max(len(e.removeprefix("ipc://").encode()) for e in endpoints)
        if longest > MAX_IPC_PATH_BYTES:
            raise ValueError(
                f"ipc path {address!r} is too long: its socket {endpoints.requests!r} is "
                f"{longest} bytes, and a unix socket path holds at most {MAX_IPC_PATH_BYTES} "
                "(use a shorter folder, or a short TMPDIR for the private one)"
            )
        return endpoints
    if address.startswith("tcp://"):
        host, sep, port_text = address[len("tcp://") :].rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65535:
            raise ValueError(
                f"tcp address must be tcp://HOST:PORT with 0 < PORT < 65535, got {address!r}"
            )
        port = int(port_text)
        return FrontendEndpoints(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")
    raise ValueError(f"frontend address must start with ipc:// or tcp://, got {address!r}")


WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def parse_tcp_address(address: str, what: str = "address") -> tuple[str, int]:
    """`tcp://HOST:PORT` or `HOST:PORT` (an IPv6 host in brackets: `[::1]:PORT`) -> (HOST, PORT).

    ValueError naming `what` for anything else, or a port outside [1, 65535]; a host "*" reads
    as "0.0.0.0" (every interface).
    """
    host, sep, port_text = address.removeprefix("tcp://").rpartition(":")
    if "://" in address and not address.startswith("tcp://"):
        sep = ""
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(
            f"{what} must be tcp://HOST:PORT (or HOST:PORT) with 0 < PORT < 65536, got {address!r}"
        )
    host = host.removeprefix("[").removesuffix("]")
    return ("0.0.0.0" if host in ("*", "") else host), int(port_text)


def is_wildcard_host(host: str) -> bool:
    """True for a host that means "every interface" when bound, and no one host to reach."""
    return host in WILDCARD_HOSTS


def remove_dead_frontend_sockets(address: str) -> None:
    """After the frontend at `address` died without cleaning up: removes its two ipc socket
    files, and their directory when it is a frontend's private one and nothing else is left in
    it. Nothing to do for tcp://. Never raises for what is already gone."""
    if not address.startswith("ipc://"):
        return
    for endpoint in frontend_endpoints(address):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint.removeprefix("ipc://"))
    folder = os.path.dirname(address.removeprefix("ipc://"))
    if os.path.basename(folder).startswith(PRIVATE_IPC_DIR_PREFIX):
        with contextlib.suppress(OSError):  # gone already, or not empty
            os.rmdir(folder)
