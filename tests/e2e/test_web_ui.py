"""The page at / (chat and engine view) in a real browser, and GET /engine/state.

The browser is the distribution's Chromium (`apt-get install chromium`, which .ci/run does)
driven by Playwright for Python; without either, the browser tests skip saying which is
missing. Screenshots go to $CORE_ENGINE_SCREENSHOT_DIR when set (the docs' come from here).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import Browser, Locator, Page, sync_playwright
except ImportError:  # the test extra brings it
    sync_playwright = None
NEEDS_BROWSER = pytest.mark.skipif(
    CHROMIUM is None or sync_playwright is None,
    reason="needs Chromium (apt-get install chromium) and Playwright (pip install playwright)"
    if CHROMIUM is None
    else "needs Playwright for Python (pip install playwright; its own browsers are not used)",
)
API_KEY = "web-ui-key"
# 2048 blocks of 16 tokens: one cell per block, and a null request runs for many seconds.
NULL_ARGS = ["--model", "null", "--max-model-len", "32000", "--num-gpu-blocks-override", "2048"]
FREE, CACHED, IN_USE, SHARED, RESERVED = "01234"
# A generous bound on what the page shows next: a loaded machine stretches its polls, never
# past this.
PAGE_EVENT_TIMEOUT_MS = 90_000


def serve(args: list[str], log_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess([*args, "--disable-log-stats"], log_dir / "core-serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def null_server(tmp_path_factory) -> Iterator[ServerProcess]:
    yield from serve(NULL_ARGS, tmp_path_factory.mktemp("null"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        yield browser
        browser.close()


def open_page(browser: Browser, base_url: str, width: int = 1280, height: int = 900) -> Page:
    """The page loaded, with every console error and page error collected in `page.errors`."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.errors = []
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.goto(base_url + "/")
    return page


def screenshot(target: Page | Locator, name: str) -> None:
    folder = os.environ.get("CORE_ENGINE_SCREENSHOT_DIR")
    if folder:
        target.screenshot(path=str(Path(folder) / name))


def grid_cells(page: Page) -> str:
    return page.eval_on_selector("#block-grids canvas", "c => c.dataset.cells || ''")


# ---- the endpoint ---------------------------------------------------------------------------


def test_engine_state_reports_the_scheduler_and_every_block(null_server):
    state = httpx.get(f"{null_server.base_url}/engine/state", timeout=10).json()
    assert state["model"] == "null"
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0
    [block_map] = state["kv_block_maps"]
    assert block_map["num_blocks"] == 2048 and block_map["blocks_per_cell"] == 1
    assert block_map["cells"] == RESERVED + FREE * 2047
    assert block_map["num_blocks_by_state"] == {
        "free": 2047, "cached": 0, "in_use": 0, "shared": 0, "reserved": 1,
    }  # fmt: skip


def test_engine_state_is_shared_for_half_a_second(null_server):
    """Many pages polling at once cost the core one utility call per half second."""
    url = f"{null_server.base_url}/engine/state"
    times = [httpx.get(url, timeout=10).json()["time"] for _ in range(5)]
    assert len(set(times)) <= 2  # five polls within ~0.5 s: one or two fetches
    time.sleep(0.6)
    assert httpx.get(url, timeout=10).json()["time"] > times[-1]


def test_engine_state_needs_the_api_key_and_the_page_can_be_disabled(tmp_path):
    server_iter = serve([*NULL_ARGS, "--api-key", API_KEY, "--disable-web-ui"], tmp_path)
    server = next(server_iter)
    try:
        url = f"{server.base_url}/engine/state"
        assert httpx.get(url, timeout=10).status_code == 401
        authorized = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert authorized.status_code == 200 and authorized.json()["kv_block_maps"]
        assert httpx.get(f"{server.base_url}/", timeout=10).status_code == 404
        assert httpx.get(f"{server.base_url}/web/app.js", timeout=10).status_code == 404
    finally:
        server_iter.close()


# ---- the page in Chromium -------------------------------------------------------------------


@NEEDS_BROWSER
def test_the_page_loads_without_console_errors(null_server, browser):
    page = open_page(browser, null_server.base_url)
    page.wait_for_function("document.querySelector('#block-grids canvas')?.dataset.cells")
    page.wait_for_function("document.getElementById('model-name').textContent.startsWith('null')")
    assert page.text_content("#stat-running") == "0"
    assert grid_cells(page) == RESERVED + FREE * 2047
    page.wait_for_timeout(1500)  # a few more polls
    assert page.errors == []
    page.close()


@NEEDS_BROWSER
def test_the_block_grid_changes_while_a_long_request_runs(null_server, browser):
    page = open_page(browser, null_server.base_url)
    page.wait_for_function("document.querySelector('#block-grids canvas')?.dataset.cells")
    idle_cells = grid_cells(page)
    idle_pixels = page.eval_on_selector("#block-grids canvas", "c => c.toDataURL()")
    assert IN_USE not in idle_cells
    stop = threading.Event()

    def long_requests() -> None:
        """One long request after another until `stop`: however fast the null model runs on
        this machine, a request is running whenever the page looks."""
        body = {"model": "null", "prompt": "x", "max_tokens": 30_000, "stream": True}
        while not stop.is_set():
            with httpx.stream(
                "POST", f"{null_server.base_url}/v1/completions", json=body, timeout=60
            ) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        return  # leaving aborts the request, which frees its blocks

    client = threading.Thread(target=long_requests)
    client.start()
    try:
        page.wait_for_function(
            "document.querySelector('#block-grids canvas').dataset.cells.includes('2')",
            timeout=PAGE_EVENT_TIMEOUT_MS,
        )
        busy_cells = grid_cells(page)
        assert busy_cells.count(IN_USE) >= 1
        # The cells grow as tokens are generated (a request is never short of that growth).
        page.wait_for_function(
            f"document.querySelector('#block-grids canvas').dataset.cells.split('2').length - 1"
            f" > {busy_cells.count(IN_USE)}",
            timeout=PAGE_EVENT_TIMEOUT_MS,
        )
        assert page.eval_on_selector("#block-grids canvas", "c => c.toDataURL()") != idle_pixels
        page.wait_for_function(
            "document.getElementById('stat-running').textContent === '1'",
            timeout=PAGE_EVENT_TIMEOUT_MS,
        )
        page.wait_for_function(
            "Number(document.getElementById('stat-gen-rate').textContent) > 0",
            timeout=PAGE_EVENT_TIMEOUT_MS,
        )
        screenshot(page.locator("#engine"), "web_ui_engine.png")
    finally:
        stop.set()
        client.join(60)
    page.wait_for_function(
        "!document.querySelector('#block-grids canvas').dataset.cells.includes('2')",
        timeout=PAGE_EVENT_TIMEOUT_MS,
    )
    assert page.errors == []
    page.close()


@NEEDS_BROWSER
def test_the_page_fits_a_narrow_window(null_server, browser):
    page = open_page(browser, null_server.base_url, width=380, height=800)
    page.wait_for_function("document.querySelector('#block-grids canvas')?.dataset.cells")
    page.click("#settings summary")  # the sampling fields open as well
    overflow = page.evaluate(
        "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0
    chat = page.locator("#chat").bounding_box()
    engine = page.locator("#engine").bounding_box()
    assert chat["width"] <= 380 and engine["width"] <= 380
    assert engine["y"] >= chat["y"] + chat["height"]  # stacked, not side by side
    screenshot(page, "web_ui_narrow.png")
    assert page.errors == []
    page.close()


@NEEDS_BROWSER
def test_the_page_asks_for_the_api_key_and_keeps_it(tmp_path, browser):
    server_iter = serve([*NULL_ARGS, "--api-key", API_KEY], tmp_path)
    server = next(server_iter)
    try:
        page = browser.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_selector("#key-needed", state="visible")
        page.fill("#api-key", API_KEY)
        page.press("#api-key", "Enter")
        page.wait_for_function("document.getElementById('model-name').textContent === "
                               "'null · max_model_len 32000'")  # fmt: skip
        page.wait_for_function("document.querySelector('#block-grids canvas')?.dataset.cells")
        assert page.evaluate("localStorage.getItem('core-engine.api-key')") == API_KEY
        assert page.is_hidden("#key-needed")
        page.close()
    finally:
        server_iter.close()


@pytest.fixture(scope="module")
def model_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The default model (SmolLM2-135M-Instruct) with a small KV cache."""
    args = ["--max-model-len", "2048", "--num-gpu-blocks-override", "512"]
    yield from serve(args, tmp_path_factory.mktemp("model"))


@NEEDS_BROWSER
def test_a_chat_message_streams_a_reply_with_its_timings(model_server, browser):
    page = open_page(browser, model_server.base_url)
    page.wait_for_function("document.getElementById('model-name').textContent.includes('max')")
    page.click("#settings summary")
    page.fill("#max-tokens", "48")
    page.fill("#temperature", "0")
    page.evaluate(
        """() => {
            window.replyUpdates = 0;
            new MutationObserver(() => window.replyUpdates++).observe(
                document.getElementById('messages'),
                {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    meta = page.wait_for_selector(".message.assistant .meta", timeout=60_000)
    reply = page.text_content(".message.assistant .content")
    assert reply.strip(), "the reply is empty"
    assert "TTFT" in meta.text_content() and "tokens/s" in meta.text_content()
    assert page.evaluate("window.replyUpdates") > 5  # streamed: many updates, not one
    assert page.input_value("#prompt") == ""
    # Shift+Enter writes a new line instead of sending.
    page.press("#prompt", "a")
    page.press("#prompt", "Shift+Enter")
    assert page.input_value("#prompt") == "a\n"
    assert page.locator(".message.user").count() == 1
    screenshot(page.locator("#chat"), "web_ui_chat.png")
    assert page.errors == []
    page.close()


@NEEDS_BROWSER
def test_json_schema_mode_answers_json(model_server, browser):
    page = open_page(browser, model_server.base_url)
    page.wait_for_function("document.getElementById('model-name').textContent.includes('max')")
    page.click("#settings summary")
    page.fill("#max-tokens", "64")
    page.fill("#temperature", "0")  # greedy: a sampled reply may not close its string in 64 tokens
    page.check("#json-mode")
    page.fill("#prompt", "Name a colour.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.assistant .meta, .message.error", timeout=60_000)
    reply = page.text_content(".message.assistant .content")
    assert "answer" in json.loads(reply)
    assert page.errors == []
    page.close()
