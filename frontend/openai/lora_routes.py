"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter (`{"lora_name", "lora_path"}`) and
POST /v1/unload_lora_adapter (`{"lora_name"}`), answered 200 with vLLM's plain-text success
line. A bad adapter is a 400 naming the field at fault, with the checkpoint's problem in the
message; unloading a name that is not loaded is a 404 naming it. The server serves on after
either. Registered only when runtime updating is allowed (`--allow-runtime-lora-updating` or
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`); otherwise they are 404s, as routes that do not exist."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse

from core_engine.frontend.lora_adapter_registry import (
    LoRAAdapterNotFoundError,
    LoRAAdapterRegistry,
)
from core_engine.frontend.openai.api_error import APIError
from core_engine.frontend.openai.protocol.lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from core_engine.proto.parameter_error import ParameterError

logger = logging.getLogger(__name__)


def add_lora_adapter_routes(app: FastAPI, check_api_key: Any) -> None:
    """The two routes, on `app.state.lora_adapters`; one change at a time."""
    lock = asyncio.Lock()
    logger.warning(
        "LoRA adapters may be loaded and unloaded at runtime (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter): any client with the API key can make this server read "
        "files from its disk"
    )

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_api_key)])
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Any:
        registry = _registry(request)
        async with lock:
            try:  # the checkpoint's files are read on a thread: streams go on meanwhile
                adapter = await asyncio.to_thread(registry.load, body.lora_name, body.lora_path)
            except ParameterError as exc:
                raise APIError(400, str(exc), param=exc.param) from exc
            except ValueError as exc:  # the engine runs without LoRA
                raise APIError(400, str(exc)) from exc
        logger.info(
            "loaded LoRA adapter %s from %s (lora_int_id %d)",
            adapter.name,
            adapter.path,
            adapter.lora_request.lora_int_id,
        )
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(check_api_key)])
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Any:
        async with lock:
            try:
                adapter = _registry(request).unload(body.lora_name)
            except LoRAAdapterNotFoundError as exc:
                raise APIError(404, str(exc), "not_found_error", param=exc.param) from exc
        logger.info("unloaded LoRA adapter %s (requests running with it finish)", adapter.name)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' removed successfully.")


def _registry(request: Request) -> LoRAAdapterRegistry:
    return request.app.state.lora_adapters
