"""Running the OpenAI-compatible app: the port, uvicorn, and the server's life cycle.

- The port is bound before anything else (uvicorn would bind it only after the engine has loaded
  its model): a busy port is a `PortInUseError` at once, naming it.
- SIGINT or SIGTERM drains: no new connections, running requests get up to
  `shutdown_timeout_s` to finish, the rest end with a "server is shutting down" error (503, or
  an SSE error event before `[DONE]`), then the engine stops and `serve` returns 0. A second
  signal skips the wait. A signal during start-up abandons it.
- Engine death: every in-flight request has already failed with the reason; the server stops the
  same way and `serve` returns 1, so that a supervisor (systemd, Kubernetes) restarts it. With
  `keep_alive_on_engine_death` it stays up answering 503 instead (the dead core is reaped).
- Start-up that fails says why in one error line, without a traceback (a worker's or the core's
  own failure is in their log lines above it): `serve` returns 2 for a setting the engine cannot
  run with (as argparse does for a bad flag: the line names the setting and its value), 3 for
  anything else (no engine core connecting to `address` in time, a core that died starting).

Exit codes of core-serve: 0 stopped by a signal, 1 the engine died while serving (or the port is
taken), 2 a bad flag or a setting the model or machine cannot run with, 3 start-up failed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from core_engine.frontend.async_engine_client import AsyncEngineClient
from core_engine.frontend.openai.app import build_app
from core_engine.frontend.openai.server_settings import ServerSettings
from core_engine.proto.engine_config import EngineConfig

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down"
# How long uvicorn waits for connections after the drain has failed what still ran: enough for
# those error responses to be written, then it cancels what is left.
CLOSE_AFTER_DRAIN_S = 5.0
EXIT_ENGINE_DEAD = 1
EXIT_CONFIG_ERROR = 2  # as argparse's usage errors
EXIT_START_FAILED = 3  # as uvicorn's own failed start-up


class PortInUseError(OSError):
    """The HTTP port cannot be bound."""


def serve(
    engine_config: EngineConfig,
    settings: ServerSettings,
    host: str = "0.0.0.0",
    port: int = 8000,
    address: str | None = None,
    keep_alive_on_engine_death: bool = False,
) -> int:
    """Serves until stopped (see the module docstring); returns the process exit code.

    Raises PortInUseError before any engine starts.
    """
    sock = bind_port(host, port)
    bound_port = sock.getsockname()[1]
    app = build_app(engine_config, settings, address)
    drain_timeout_s = engine_config.shutdown_timeout_s
    config = uvicorn.Config(
        app,
        host=host,  # uvicorn serves `sock`; these are what `EngineServer` logs as its URL
        port=bound_port,
        log_level="info",
        timeout_graceful_shutdown=drain_timeout_s + CLOSE_AFTER_DRAIN_S,
    )
    server = EngineServer(config, app, drain_timeout_s, keep_alive_on_engine_death)
    # uvicorn logs no address for a socket it is given: say where the server will be.
    logger.info("listening on %s; serving once the engine is ready", server_url(host, bound_port))
    server.run(sockets=[sock])
    if (failure := app.state.start_failure) is not None:
        return EXIT_CONFIG_ERROR if failure.is_config_error else EXIT_START_FAILED
    return EXIT_ENGINE_DEAD if server.engine_death_reason is not None else 0


def server_url(host: str, port: int) -> str:
    """http://HOST:PORT, the host in brackets when it is an IPv6 address."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_port(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when `host` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(
            exc.errno, f"cannot listen on {host}:{port}: {exc.strerror} (is another server there?)"
        ) from None
    sock.listen(2048)
    return sock


class EngineServer(uvicorn.Server):
    """uvicorn's server with the engine's life cycle: signals drain, engine death exits.

    Invariant: `engine_death_reason` is set iff the server stopped because the engine died.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        app: FastAPI,
        drain_timeout_s: float,
        keep_alive_on_engine_death: bool,
    ) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.engine_death_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_stop_signals = 0
        self._death_watch: asyncio.Task | None = None
        self._stop_tasks: set[asyncio.Task] = set()

    @property
    def engine(self) -> AsyncEngineClient | None:
        """The engine client, once it is ready."""
        return self.app.state.engine

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if (failure := self.app.state.start_failure) is not None:  # said plainly, in one line
            what = "cannot run with these settings" if failure.is_config_error else "cannot start"
            logger.error("the engine %s: %s; exiting", what, failure.message)
            self.should_exit = True
        if self.engine is not None:
            self._death_watch = asyncio.create_task(self._exit_on_engine_death(self.engine))
            url = server_url(self.config.host, self.config.port)
            logger.info("serving on %s (OpenAI base URL: %s/v1)", url, url)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._death_watch is not None:
            self._death_watch.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler, replaced: the first signal drains, a second one stops the
        rest at once. Unlike uvicorn, the signal is not raised again after shutdown: a stop that
        was asked for exits 0. Runs between bytecodes of the loop's thread: it only schedules."""
        self._num_stop_signals += 1
        self.should_exit = True
        if self._loop is None:  # before serve(): nothing runs yet
            return
        if self._num_stop_signals == 1:
            self._loop.call_soon_threadsafe(self._start_draining, signal.Signals(sig).name)
        else:
            self._loop.call_soon_threadsafe(self._stop_serving)

    def _start_draining(self, signal_name: str) -> None:
        self.app.state.stop_requested.set()  # abandons a start-up in progress
        if self.engine is None:
            logger.info("%s received during start-up: stopping", signal_name)
            return
        logger.info(
            "%s received: accepting no new connections; %d running requests get up to %.0f s "
            "to finish (--shutdown-timeout-s), then end with %r",
            signal_name,
            self.engine.num_running_requests,
            self.drain_timeout_s,
            SHUTTING_DOWN,
        )
        self._loop.call_later(self.drain_timeout_s, self._stop_serving)

    def _stop_serving(self) -> None:
        """Ends whatever still runs with SHUTTING_DOWN (and refuses anything new)."""
        if self.engine is None or self.engine.is_dead:
            return
        if num_running := self.engine.num_running_requests:
            logger.info("ending %d running requests: %s", num_running, SHUTTING_DOWN)
        task = asyncio.get_running_loop().create_task(self.engine.stop_serving(SHUTTING_DOWN))
        self._stop_tasks.add(task)  # a strong reference until it is done
        task.add_done_callback(self._stop_tasks.discard)

    async def _exit_on_engine_death(self, engine: AsyncEngineClient) -> None:
        reason = await engine.wait_until_dead()
        if self.should_exit:  # a stop we asked for
            return
        if self.keep_alive_on_engine_death:
            logger.error(
                "the engine is dead (%s); answering 503 until stopped "
                "(--keep-alive-on-engine-death)",
                reason,
            )
            return
        logger.error("the engine is dead (%s); exiting so that a supervisor restarts it", reason)
        self.engine_death_reason = reason
        self.should_exit = True
