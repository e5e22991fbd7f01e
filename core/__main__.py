"""`python -m core_engine.core --frontend-address ADDR [--config B64] [--model ... engine flags]`.

Runs one engine core process that connects to a frontend bound at ADDR (`ipc://PATH` or
`tcp://HOST:PORT`, see `proto.endpoints`). `AsyncCoreClient` launches it with `--config` and
`--watch-parent`; started by hand it takes the same engine flags as `EngineConfig` fields
(`--max-num-seqs 64`, `--no-enable-prefix-caching`, ...), which override `--config`, and serves
one client after another (`core-serve --frontend-address ADDR`, `EngineClient(config, ADDR)`):
each is greeted when it binds ADDR, and each one's requests are aborted when it goes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from core_engine.common.process_watch import exit_when_orphaned
from core_engine.core.engine_core_proc import EngineCoreProc
from core_engine.proto.endpoints import frontend_endpoints, remove_dead_frontend_sockets
from core_engine.proto.engine_config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core_engine.core", description=__doc__)
    parser.add_argument("--frontend-address", required=True, help="ipc://PATH or tcp://HOST:PORT")
    parser.add_argument("--config", default=None, help="a base EngineConfig.to_b64()")
    parser.add_argument(
        "--watch-parent", action="store_true", help="shut down when the launching process dies"
    )
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(argv)
    try:
        base = EngineConfig.from_b64(args.config) if args.config else None
        config = EngineConfig.from_cli_args(args, base)
        frontend_endpoints(args.frontend_address)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s"
    )
    if args.watch_parent:
        # A frontend killed outright leaves its socket files; the core it launched removes them.
        exit_when_orphaned(
            os.getppid(),
            grace_s=3 * config.shutdown_timeout_s,
            on_orphaned=lambda: remove_dead_frontend_sockets(args.frontend_address),
        )
    return EngineCoreProc(config, args.frontend_address).run(launched_by_frontend=args.watch_parent)


if __name__ == "__main__":
    sys.exit(main())
