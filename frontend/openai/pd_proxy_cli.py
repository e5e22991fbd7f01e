"""`core-pd-proxy`: the prefill/decode router on the command line.

core-pd-proxy --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --port 8000
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import uvicorn

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8000


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="core-pd-proxy",
        description="Route OpenAI completion and chat requests through a prefill instance "
        "(TcpConnector kv_producer) and a decode instance (kv_consumer).",
    )
    parser.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    parser.add_argument("--decode", required=True, help="base URL of the decode instance")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"default: {DEFAULT_HOST}")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default: {DEFAULT_PORT}")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="limit on each upstream request (default: 600)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise SystemExit(f"--{name} must be an http:// or https:// URL, got {url!r}")
    try:
        from core_engine.frontend.openai.pd_proxy import build_proxy_app
    except ModuleNotFoundError as exc:
        if exc.name != "httpx":
            raise
        raise SystemExit(
            "core-pd-proxy needs httpx, an optional dependency: pip install 'core-engine[pd]'"
        ) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_proxy_app(args.prefill, args.decode, args.timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
