"""`core-serve`: the OpenAI-compatible server on the command line (flags named as in vLLM).

core-serve                                  # the default SmolLM2-135M-Instruct GGUF
core-serve null --port 8001                 # the model-free null worker
core-serve /models/Qwen2-0.5B --max-num-seqs 64 --api-key secret   # or --model PATH
core-serve /models/Qwen2-0.5B --enable-lora --lora-modules sql=/adapters/sql   # model "sql"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from core_engine.frontend.openai.http_server import PortInUseError, serve
from core_engine.frontend.openai.lora_modules import LoRAModulePath, parse_lora_module
from core_engine.frontend.openai.server_settings import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerSettings,
)
from core_engine.frontend.openai.tool_calls import TOOL_CALL_PARSERS
from core_engine.proto.engine_config import EngineConfig

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8000
API_KEY_ENV = "CORE_ENGINE_API_KEY"
# vLLM's switch for the runtime LoRA routes: "1" or "true" (any case) turns them on.
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOG_STATS_INTERVAL_S = 10.0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="core-serve",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as in `vllm serve MODEL` (the same as --model)",
    )
    EngineConfig.add_cli_arguments(parser)  # --model, --device, --max-num-seqs, ...
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"interface to listen on (default: {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $CORE_ENGINE_API_KEY, "
        "which `ps` does not show)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients may send as `model`; responses carry the first (default: the "
        f"MODEL or --model string as given, or {DEFAULT_SERVED_MODEL_NAME} for the default model)",
    )
    parser.add_argument(
        "--frontend-address",
        default=None,
        help="ipc:// or tcp:// address to wait on for an engine core started separately "
        "(`python -m core_engine.core --frontend-address ADDR`); default: start the core here",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='how to read tool calls back from the model\'s text, for tool_choice "auto" '
        '(hermes: <tool_call>{"name": ..., "arguments": ...}</tool_call>); "required" and '
        "named tool choices work without it",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are answered 413 before they are read",
    )
    parser.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="when the engine dies, stay up answering 503 instead of exiting with code 1 (the "
        "default, so that a supervisor restarts the server)",
    )
    parser.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the chat and engine page at / (GET /engine/state stays)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="MODULE",
        help="LoRA adapters to serve (needs --enable-lora), each name=path or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; clients send the name as `model`',
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
        f"--enable-lora; also turned on by ${RUNTIME_LORA_UPDATING_ENV}=1, as in vLLM)",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help=f"do not log throughput and cache stats every {LOG_STATS_INTERVAL_S:.0f} s",
    )
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[EngineConfig, ServerSettings, argparse.Namespace]:
    """Engine config and server settings from the command line; exits with usage on errors."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(
                f"the model is given twice, as MODEL {args.model_tag!r} and as --model "
                f"{args.model!r}: give one"
            )
        args.model = args.model_tag
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.max_request_body_bytes < 1024:
        parser.error(
            f"--max-request-body-bytes must be at least 1024, got {args.max_request_body_bytes}"
        )
    try:
        engine_config = EngineConfig.from_cli_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.frontend_address is not None and engine_config.data_parallel_size > 1:
        parser.error(
            f"--data-parallel-size {engine_config.data_parallel_size} launches its own engine "
            "cores; --frontend-address attaches to one core started separately"
        )
    if args.frontend_address is not None and engine_config.data_parallel_backend == "ray":
        parser.error(
            "--data-parallel-backend ray has Ray place the engine cores; --frontend-address "
            "attaches to one core started separately"
        )
    lora_modules = _lora_modules(parser, args, engine_config)
    settings = ServerSettings(
        served_model_names=tuple(
            args.served_model_name or [engine_config.model or DEFAULT_SERVED_MODEL_NAME]
        ),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        log_stats_interval_s=None if args.disable_log_stats else LOG_STATS_INTERVAL_S,
        tool_call_parser=args.tool_call_parser,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_web_ui=not args.disable_web_ui,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=(
            args.allow_runtime_lora_updating or runtime_lora_updating_from_env()
        ),
    )
    return engine_config, settings, args


def runtime_lora_updating_from_env() -> bool:
    """vLLM's rule for its switch: "1" or "true", any case, around spaces."""
    return os.environ.get(RUNTIME_LORA_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def _lora_modules(
    parser: argparse.ArgumentParser, args: argparse.Namespace, engine_config: EngineConfig
) -> tuple[LoRAModulePath, ...]:
    """The --lora-modules values; a usage error for a malformed one, a name given twice, or
    LoRA flags without --enable-lora."""
    if not engine_config.enable_lora:
        for flag, given in (
            ("--lora-modules", bool(args.lora_modules)),
            ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating),
        ):
            if given:
                parser.error(
                    f"{flag} needs --enable-lora (without it the engine serves no adapters)"
                )
    modules = []
    for text in args.lora_modules:
        try:
            modules.append(parse_lora_module(text))
        except ValueError as exc:
            parser.error(f"--lora-modules: {exc}")
    names = [module.name for module in modules]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        parser.error(f"--lora-modules names {', '.join(repeated)} more than once")
    return tuple(modules)


def main(argv: Sequence[str] | None = None) -> None:
    engine_config, settings, args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        exit_code = serve(
            engine_config,
            settings,
            args.host,
            args.port,
            args.frontend_address,
            keep_alive_on_engine_death=args.keep_alive_on_engine_death,
        )
    except PortInUseError as exc:
        logging.getLogger("core-serve").error("%s", exc.strerror)
        sys.exit(1)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
