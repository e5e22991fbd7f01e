// The core-engine page: a chat playground over /v1/chat/completions and a live view of
// GET /engine/state. No dependencies, nothing fetched from outside this server.
"use strict";

const KEY_STORAGE = "core-engine.api-key";
const POLL_INTERVAL_MS = 1000;
const CHART_WINDOW_S = 300;
const STATE_COLORS = ["--free", "--cached", "--in-use", "--shared", "--reserved"];

const $ = (id) => document.getElementById(id);
const conversation = [];
const rateSamples = []; // {t, prompt, generation}: counters from /engine/state
let modelName = null;
let generation = null; // the AbortController of the reply streaming now

function authHeaders() {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function showKeyNeeded(needed) {
  $("key-needed").hidden = !needed;
}

async function apiFetch(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  showKeyNeeded(response.status === 401);
  return response;
}

// ---- chat ------------------------------------------------------------------------------------

async function loadModel() {
  try {
    const response = await apiFetch("/v1/models");
    if (!response.ok) {
      $("model-name").textContent = response.status === 401 ? "API key needed" : "no model";
      return;
    }
    const body = await response.json();
    modelName = body.data[0].id;
    $("model-name").textContent = `${modelName} · max_model_len ${body.data[0].max_model_len}`;
  } catch (error) {
    $("model-name").textContent = "server unreachable";
  }
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const content = document.createElement("span");
  content.className = "content";
  content.textContent = text;
  element.appendChild(content);
  $("messages").appendChild(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

function addMeta(element, text) {
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = text;
  element.appendChild(meta);
}

function numberOrNull(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function requestBody() {
  const body = {
    model: modelName,
    messages: conversation,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberOrNull("temperature"),
    top_p: numberOrNull("top-p"),
    max_tokens: numberOrNull("max-tokens"),
    seed: numberOrNull("seed"),
  };
  const stops = $("stop").value.split("\n").filter((line) => line !== "");
  if (stops.length) body.stop = stops;
  if ($("json-mode").checked) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse($("json-schema").value) },
    };
  }
  for (const name of Object.keys(body)) if (body[name] === null) delete body[name];
  return body;
}

// Yields each `data:` payload of a server-sent event stream.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  if (generation !== null || text.trim() === "") return;
  let body;
  try {
    conversation.push({ role: "user", content: text });
    body = requestBody();
  } catch (error) {
    conversation.pop();
    addMessage("error", `the JSON schema is not JSON: ${error.message}`);
    return;
  }
  addMessage("user", text);
  $("prompt").value = "";
  const reply = addMessage("assistant", "");
  const content = reply.querySelector(".content");
  generation = new AbortController();
  $("stop-generation").hidden = false;
  const sentAt = performance.now();
  let firstAt = null;
  let usage = null;
  let finishReason = null;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: generation.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error ? error.error.message : `HTTP ${response.status}`);
    }
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta.content || "";
        if (delta && firstAt === null) firstAt = performance.now();
        content.textContent += delta;
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      reply.scrollIntoView({ block: "end" });
    }
    conversation.push({ role: "assistant", content: content.textContent });
    addMeta(reply, replyMeta(sentAt, firstAt, performance.now(), usage, finishReason));
  } catch (error) {
    conversation.pop();
    if (error.name === "AbortError") {
      addMeta(reply, "stopped");
    } else {
      reply.className = "message error";
      content.textContent += (content.textContent ? "\n" : "") + error.message;
    }
  } finally {
    generation = null;
    $("stop-generation").hidden = true;
  }
}

function replyMeta(sentAt, firstAt, endAt, usage, finishReason) {
  const parts = [];
  if (firstAt !== null) parts.push(`TTFT ${Math.round(firstAt - sentAt)} ms`);
  const numTokens = usage ? usage.completion_tokens : null;
  if (numTokens !== null && firstAt !== null && numTokens > 1 && endAt > firstAt) {
    // The first token's time is TTFT's; the rate is over the tokens after it.
    parts.push(`${(((numTokens - 1) * 1000) / (endAt - firstAt)).toFixed(1)} tokens/s`);
  }
  if (numTokens !== null) parts.push(`${numTokens} tokens`);
  if (finishReason) parts.push(`finish: ${finishReason}`);
  return parts.join(" · ");
}

// ---- engine ----------------------------------------------------------------------------------

function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const cssWidth = canvas.clientWidth;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.max(1, Math.round(cssWidth * ratio));
  canvas.height = Math.max(1, Math.round(cssHeight * ratio));
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { context, width: cssWidth, height: cssHeight };
}

function drawBlockGrid(canvas, blockMap) {
  const numCells = blockMap.cells.length;
  const width = canvas.clientWidth || 300;
  // Square cells, as large as fits about 220 px of height.
  let cell = Math.max(2, Math.floor(Math.sqrt((width * 220) / numCells)));
  cell = Math.min(cell, 24);
  const columns = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(numCells / columns);
  const { context } = fitCanvas(canvas, rows * cell);
  const colors = STATE_COLORS.map(cssColor);
  const gap = cell >= 6 ? 1 : 0;
  for (let index = 0; index < numCells; index++) {
    context.fillStyle = colors[Number(blockMap.cells[index])];
    const x = (index % columns) * cell;
    const y = Math.floor(index / columns) * cell;
    context.fillRect(x, y, cell - gap, cell - gap);
  }
  canvas.dataset.cells = blockMap.cells;
}

function drawBlockGrids(state) {
  const container = $("block-grids");
  while (container.children.length > state.kv_block_maps.length) container.lastChild.remove();
  while (container.children.length < state.kv_block_maps.length) {
    const canvas = document.createElement("canvas");
    canvas.setAttribute("role", "img");
    container.appendChild(canvas);
  }
  state.kv_block_maps.forEach((blockMap, rank) => {
    const canvas = container.children[rank];
    canvas.setAttribute("aria-label", `KV cache blocks of core ${rank}`);
    drawBlockGrid(canvas, blockMap);
  });
  const counts = { free: 0, cached: 0, in_use: 0, shared: 0, num_blocks: 0 };
  let blocksPerCell = 1;
  for (const blockMap of state.kv_block_maps) {
    for (const name of ["free", "cached", "in_use", "shared"]) {
      counts[name] += blockMap.num_blocks_by_state[name];
    }
    counts.num_blocks += blockMap.num_blocks;
    blocksPerCell = Math.max(blocksPerCell, blockMap.blocks_per_cell);
  }
  $("block-summary").textContent =
    `${counts.num_blocks} blocks: ${counts.in_use} in use, ${counts.shared} shared, ` +
    `${counts.cached} cached, ${counts.free} free` +
    (blocksPerCell > 1 ? ` (one cell per ${blocksPerCell} blocks)` : "");
}

function recordRates(state) {
  rateSamples.push({
    t: state.time,
    prompt: state.num_prompt_tokens,
    generation: state.num_generation_tokens,
  });
  while (rateSamples.length > 2 && rateSamples[0].t < state.time - CHART_WINDOW_S - 1) {
    rateSamples.shift();
  }
}

function rates() {
  const points = [];
  for (let i = 1; i < rateSamples.length; i++) {
    const before = rateSamples[i - 1];
    const after = rateSamples[i];
    const seconds = after.t - before.t;
    if (seconds <= 0) continue;
    points.push({
      t: after.t,
      prompt: Math.max(0, after.prompt - before.prompt) / seconds,
      generation: Math.max(0, after.generation - before.generation) / seconds,
    });
  }
  return points;
}

function drawChart(points, now) {
  const { context, width, height } = fitCanvas($("rate-chart"), 160);
  const pad = { left: 44, right: 6, top: 8, bottom: 18 };
  const peak = Math.max(1, ...points.map((p) => Math.max(p.prompt, p.generation)));
  const x = (t) => pad.left + ((t - (now - CHART_WINDOW_S)) / CHART_WINDOW_S) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (v / peak) * (height - pad.top - pad.bottom);
  context.clearRect(0, 0, width, height);
  context.strokeStyle = cssColor("--line");
  context.fillStyle = cssColor("--muted");
  context.font = "11px system-ui, sans-serif";
  context.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const value = peak * fraction;
    context.beginPath();
    context.moveTo(pad.left, y(value));
    context.lineTo(width - pad.right, y(value));
    context.stroke();
    context.fillText(value >= 100 ? value.toFixed(0) : value.toFixed(1), 2, y(value) + 4);
  }
  context.fillText("-5 min", pad.left, height - 4);
  context.fillText("now", width - pad.right - 22, height - 4);
  for (const [series, color] of [["prompt", "--prompt"], ["generation", "--generation"]]) {
    context.strokeStyle = cssColor(color);
    context.lineWidth = 2;
    context.beginPath();
    points.forEach((point, index) => {
      const move = index === 0 ? context.moveTo : context.lineTo;
      move.call(context, x(point.t), y(point[series]));
    });
    context.stroke();
  }
}

function showStats(state, points) {
  $("stat-running").textContent = state.num_running_reqs;
  $("stat-waiting").textContent = state.num_waiting_reqs;
  $("stat-kv").textContent = `${(state.kv_cache_usage * 100).toFixed(1)}%`;
  $("stat-hit-rate").textContent =
    state.prefix_cache_queries ? `${(state.prefix_cache_hit_rate * 100).toFixed(1)}%` : "–";
  $("stat-preemptions").textContent = state.num_preemptions;
  const last = points[points.length - 1];
  $("stat-gen-rate").textContent = last ? last.generation.toFixed(1) : "–";
}

async function pollEngine() {
  try {
    const response = await apiFetch("/engine/state");
    if (!response.ok) throw new Error(`GET /engine/state: HTTP ${response.status}`);
    const state = await response.json();
    recordRates(state);
    const points = rates();
    showStats(state, points);
    drawBlockGrids(state);
    drawChart(points, state.time);
    $("engine-error").hidden = true;
  } catch (error) {
    $("engine-error").textContent = error.message;
    $("engine-error").hidden = false;
  } finally {
    setTimeout(pollEngine, POLL_INTERVAL_MS);
  }
}

// ---- wiring ----------------------------------------------------------------------------------

function start() {
  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
  keyInput.addEventListener("change", () => {
    const key = keyInput.value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
    loadModel();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send($("prompt").value);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send($("prompt").value);
    }
  });
  $("stop-generation").addEventListener("click", () => generation && generation.abort());
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
  });
  loadModel();
  pollEngine();
}

start();
