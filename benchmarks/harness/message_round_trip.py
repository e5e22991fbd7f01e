"""`MessageRoundTrip`: what the core <-> worker link costs one message, measured on real messages."""

from __future__ import annotations

import socket

from core_engine.proto import MessageDecoder, MessageEncoder, ModelRunnerOutput, SchedulerOutput
from core_engine.proto.message_pipe import MessagePipe


class MessageRoundTrip:
    """Sends a message through a socketpair and decodes it on the other end, as the engine's
    core <-> worker link does (both ends in this process: no process wake-up is counted)."""

    def __init__(self) -> None:
        left, right = socket.socketpair()
        self.sender, self.receiver = MessagePipe(left), MessagePipe(right)
        self.encoder = MessageEncoder()
        self.decoder = MessageDecoder((SchedulerOutput, ModelRunnerOutput))

    def __call__(self, message) -> None:
        self.sender.send(self.encoder.encode(message))
        self.decoder.decode(self.receiver.recv())
