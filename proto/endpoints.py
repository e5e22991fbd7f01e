"""How one frontend address names the two sockets of the frontend <-> engine core link.

The frontend binds, the core connects, and both derive the pair from the same single address, so
`python -m core --frontend-address ADDR` and `AsyncCoreClient(config, ADDR)` always agree.
"""

from __future__ import annotations

from typing import NamedTuple


class FrontendEndpoints(NamedTuple):
    requests: str
    """Frontend ROUTER <- core DEALER: requests, aborts, utility calls; the core's EngineReady."""
    outputs: str
    """Frontend PULL <- core PUSH: EngineCoreOutputs, UtilityResponse, EngineDead."""


def frontend_endpoints(address: str) -> FrontendEndpoints:
    """`tcp://HOST:PORT` -> PORT and PORT+1; `ipc://PATH` -> `PATH-requests`, `PATH-outputs`.

    Raises ValueError for any other scheme or a TCP address without an explicit port.
    """
    if address.startswith("ipc://"):
        return FrontendEndpoints(f"{address}-requests", f"{address}-outputs")
    if address.startswith("tcp://"):
        host, sep, port_text = address[len("tcp://") :].rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65535:
            raise ValueError(
                f"tcp address must be tcp://HOST:PORT with 0 < PORT < 65535, got {address!r}"
            )
        port = int(port_text)
        return FrontendEndpoints(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")
    raise ValueError(f"frontend address must start with ipc:// or tcp://, got {address!r}")
