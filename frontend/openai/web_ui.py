"""The web page at / (a chat playground and a live view of the engine) and GET /engine/state.

The page is static (frontend/openai/web/: HTML, JS, CSS; nothing fetched from elsewhere) and
talks to the server through the API a client uses: /v1/models, /v1/chat/completions and
/engine/state, the last polled about once a second. With `--api-key` the page asks for the key
and keeps it in the browser. `--disable-web-ui` removes the page (404 at /); /engine/state
stays, needing the key like the API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from core_engine.frontend.openai.engine_state_cache import EngineStateCache
from core_engine.frontend.openai.protocol.engine_state import EngineState
from core_engine.frontend.openai.server_settings import ServerSettings

WEB_DIR = Path(__file__).parent / "web"
ENGINE_STATE_MAX_AGE_S = 0.5  # many open pages share one utility call per this long


def add_web_ui_routes(app: FastAPI, settings: ServerSettings, check_api_key: Any) -> None:
    """GET /engine/state always; the page (/ and /web/...) unless `settings.enable_web_ui` is
    False. `check_api_key` is the API's key dependency."""
    state_cache = EngineStateCache(settings.served_model_name, ENGINE_STATE_MAX_AGE_S)
    app.state.engine_state_cache = state_cache

    @app.get("/engine/state", dependencies=[Depends(check_api_key)])
    async def engine_state(request: Request) -> EngineState:
        return await state_cache.get(request.app.state.engine)

    if not settings.enable_web_ui:
        return

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
