"""`BodySizeLimit`: an ASGI middleware that answers 413, in OpenAI's error body, to a request
whose body is larger than the server accepts, before the body is read into memory.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives and refused when it passes the limit.
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, int(declared))
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Answer now; the app sees a client that left and its answer is dropped.
                    refused = True
                    await self._refuse(send, received)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Any, num_bytes: int) -> None:
        error = {
            "message": (
                f"the request body has {num_bytes} bytes or more, over this server's limit of "
                f"{self.max_body_bytes}"
            ),
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
        body = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
