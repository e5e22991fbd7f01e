"""`ClientWatch`: whether a frontend client is connected to the engine core, and when one
arrives or departs.

The core's DEALER connects to one frontend address, so at most one client is connected at a
time, and a client that stops is followed by the next one to bind that address (zmq reconnects
on its own). The watch reads the DEALER's socket monitor: a finished ZMTP handshake is an
arrival, a lost connection a departure.

Why a socket monitor and not a hello message from the client: a client's ROUTER can address
the core only after the core has sent it a frame (that frame names the core's routing id), so
the core has to speak first on every new connection anyway; and a client killed with SIGKILL
says no goodbye, while its connection's end is seen at once. A client host that vanishes
without closing its connections is turned into a departure by ZMTP heartbeats on the DEALER.
"""

from __future__ import annotations

import enum

import zmq
from zmq.utils.monitor import parse_monitor_message

HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000


class ClientEvent(enum.Enum):
    ARRIVED = "arrived"
    DEPARTED = "departed"


class ClientWatch:
    """Arrivals and departures of the frontend client on `socket` (a connecting DEALER).

    Invariants: `is_connected` is True iff the last event read was an arrival; the events
    `take_events` returns alternate between ARRIVED and DEPARTED, the first one being the
    opposite of the state its previous call left. `read_events` never blocks.
    """

    def __init__(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._socket = socket
        # Monitoring starts before connect(), so that no connection goes unseen.
        self.monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.is_connected = False
        self._events: list[ClientEvent] = []

    def read_events(self) -> None:
        """Reads the monitor's pending events into the queue `take_events` empties."""
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.is_connected:
                self.is_connected = True
                self._events.append(ClientEvent.ARRIVED)
            elif event == zmq.EVENT_DISCONNECTED and self.is_connected:
                # A DISCONNECTED without a handshake before it was never a client.
                self.is_connected = False
                self._events.append(ClientEvent.DEPARTED)

    def take_events(self) -> list[ClientEvent]:
        """The arrivals and departures read since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._socket.disable_monitor()
        self.monitor.close(linger=0)
