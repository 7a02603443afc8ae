// The review page: POST the lines to v1/sentiment, render label + confidence bars, show the model
// version (v1/models/NAME) and poll readyz. URLs are relative so a path-prefix proxy works too.
"use strict";

const POLL_MS = 5000;
const TIMEOUT_MS = 15000;
const MODEL = document.body.dataset.model;
const $ = (id) => document.getElementById(id);

// fetch JSON with a timeout; throws Error(message in words) on network failure or HTTP error.
async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { cache: "no-store", ...options, signal: AbortSignal.timeout(TIMEOUT_MS) });
  } catch (err) {
    const why = err.name === "TimeoutError" ? `no answer within ${TIMEOUT_MS / 1000} s` : err.message;
    throw Object.assign(new Error(`Could not reach the server (${why}).`), { unreachable: true });
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (e.g. a proxy's HTML error page): fall back to the status line below
  }
  if (!response.ok) {
    const message = body && typeof body.error === "string" ? body.error : response.statusText || "no details";
    throw Object.assign(new Error(`The server answered ${response.status}: ${message}`), { status: response.status });
  }
  return { body, response };
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// -- model name, version and health ----------------------------------------------------------------

function setHealth(state, text) {
  $("health").dataset.state = state;
  $("health-text").textContent = text;
}

async function refreshModel() {
  try {
    const { body } = await api(`v1/models/${encodeURIComponent(MODEL)}`);
    const live = body.model_version_status.filter((s) => s.state === "AVAILABLE").map((s) => s.version);
    $("model-version").textContent = live.length
      ? `version ${live.join(", ")}` : "no version available";
  } catch (err) {
    $("model-version").textContent = "version unknown";
  }
}

let pollTimer;
async function pollHealth() {
  clearTimeout(pollTimer);
  try {
    await api("readyz");
    setHealth("ready", "ready");
    await refreshModel();
  } catch (err) {
    if (err.unreachable) setHealth("down", "server unreachable");
    else setHealth("not-ready", err.message.replace(/^The server answered \d+: /, ""));
  }
  pollTimer = setTimeout(pollHealth, POLL_MS);
}

// -- predictions ---------------------------------------------------------------------------------

function renderResult(text, result) {
  const pct = `${(result.score * 100).toFixed(1)}%`;
  const item = document.createElement("li");
  item.className = `result ${result.label}`;
  item.innerHTML = `<p class="text"></p>
    <div class="verdict">
      <span class="label"></span>
      <span class="bar" aria-hidden="true"><span class="fill"></span></span>
      <span class="pct"></span>
    </div>`;
  item.querySelector(".text").textContent = text;
  item.querySelector(".label").textContent = result.label;
  item.querySelector(".fill").style.width = pct;
  item.querySelector(".pct").textContent = pct;
  item.querySelector(".pct").setAttribute("aria-label", `confidence ${pct}`);
  return item;
}

// after an error: don't leave old results looking like answers to the new input
function clearResults() {
  $("results").replaceChildren();
  $("results-meta").textContent = "";
}

async function predict() {
  const texts = $("reviews").value.split("\n").map((t) => t.trim()).filter(Boolean);
  if (!texts.length) {
    showError("Type or paste at least one review, one per line.");
    clearResults();
    return;
  }
  const button = $("predict");
  if (button.disabled) return; // a request is already on its way (Ctrl+Enter twice)
  button.disabled = true;
  $("results").setAttribute("aria-busy", "true");
  try {
    const started = performance.now();
    const { body, response } = await api("v1/sentiment", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ texts }),
    });
    showError("");
    $("results").replaceChildren(...body.map((result, i) => renderResult(texts[i], result)));
    const version = response.headers.get("X-Model-Version");
    const ms = Math.round(performance.now() - started);
    $("results-meta").textContent =
      `· ${texts.length} review${texts.length === 1 ? "" : "s"}${version ? `, version ${version}` : ""}, ${ms} ms`;
  } catch (err) {
    showError(err.message);
    clearResults();
    if (err.unreachable) pollHealth(); // update the health line now, not at the next poll
  } finally {
    button.disabled = false;
    $("results").removeAttribute("aria-busy");
  }
}

$("model-name").textContent = MODEL;
$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  predict();
});
$("reviews").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
pollHealth();
