// The review page: POST the lines to v1/sentiment, render label + confidence bars, then ask
// v1/models/NAME:explain why and highlight each review's words by their contribution; show the
// model version (v1/models/NAME) and poll readyz and the drift monitoring (v1/models/NAME/monitoring). URLs are relative so a path-prefix proxy works too.
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

// -- drift monitoring --------------------------------------------------------------------------------

const STATISTICS = {
  words: "Length in words",
  unknown_ngram_share: "Unknown n-grams (share of a review's)",
  positive_probability: "Predicted probability of positive",
};
const percent = (share) => (share === null || share === undefined ? "–" : `${Math.round(share * 100)}%`);

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// One statistic: each bin's share in the window beside the held-out reviews', and its PSI.
function histogram(name, statistic) {
  const figure = element("figure", "histogram");
  figure.dataset.statistic = name;
  const bins = element("div", "bins");
  const highest = Math.max(...statistic.shares, ...statistic.baseline_shares, 1e-9);
  statistic.shares.forEach((share, i) => {
    const pair = element("span", "pair");
    for (const [kind, value] of [["base", statistic.baseline_shares[i]], ["now", share]]) {
      const bar = element("span", `bar-${kind}`);
      bar.style.setProperty("--share", (value / highest).toFixed(3));
      bar.title = `${kind === "now" ? "served" : "held-out"}: ${percent(value)}`;
      pair.append(bar);
    }
    bins.append(pair);
  });
  bins.setAttribute("aria-hidden", "true");
  const shifted = statistic.psi > 0.25;
  figure.append(bins, element("figcaption", shifted ? "shifted" : "", `${STATISTICS[name]} · PSI ${statistic.psi.toFixed(2)}`));
  return figure;
}

function renderMonitoredVersion(version) {
  const card = element("article", "monitor");
  card.dataset.version = version.version;
  card.append(element("h3", "", `Version ${version.version}`));
  const line = element("p", "drift-line");
  card.append(line);
  if (version.monitoring !== "on") {
    line.dataset.verdict = "off";
    line.textContent = `Not monitored: ${version.monitoring.replace(/^off: /, "")}`;
    return card;
  }
  const window = version.windows && version.windows.reviews;
  if (!window || !window.reviews) {
    line.dataset.verdict = "warming_up";
    line.textContent = "No reviews answered yet.";
    return card;
  }
  line.dataset.verdict = window.verdict;
  line.textContent = window.verdict === "ok" ? "Looks like training data."
    : window.summary.charAt(0).toUpperCase() + window.summary.slice(1) + ".";
  card.append(element("p", "meta",
    `${window.reviews} of the last ${window.size} reviews · ${percent(window.unlike_training_share)} unlike training ` +
    `(held-out: ${percent(version.baseline.unlike_training_share)}) · ${percent(window.low_confidence_share)} ` +
    `low-confidence answers (held-out: ${percent(version.baseline.low_confidence_share)})`));
  const charts = element("div", "histograms");
  for (const name of Object.keys(STATISTICS)) charts.append(histogram(name, window.statistics[name]));
  card.append(charts);
  return card;
}

async function refreshMonitoring() {
  try {
    const { body } = await api(`v1/models/${encodeURIComponent(MODEL)}/monitoring`);
    $("monitoring-versions").replaceChildren(...body.versions.map(renderMonitoredVersion));
    $("monitoring-status").textContent = "";
  } catch (err) {
    $("monitoring-status").textContent = `Monitoring unavailable: ${err.message}`;
  }
}

let pollTimer;
async function pollHealth() {
  clearTimeout(pollTimer);
  try {
    await api("readyz");
    setHealth("ready", "ready");
    await refreshModel();
    await refreshMonitoring();
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

// -- explanations ----------------------------------------------------------------------------------

// The model's text cleaning (common/vectorizer.py): <br> and punctuation separate words, apostrophes
// are dropped, case is folded. Returns each word of `text` with where it is.
const SEPARATOR = /<br\s*\/?>|[!"#$%&()*+,\-./:;<=>?@[\\\]^_`{|}~\s]/giu;
function words(text) {
  const out = [];
  let start = 0;
  const add = (end) => {
    const word = text.slice(start, end).toLowerCase().replaceAll("'", "");
    if (word) out.push({ word, start, end });
  };
  for (const match of text.matchAll(SEPARATOR)) {
    add(match.index);
    start = match.index + match[0].length;
  }
  add(text.length);
  return out;
}

// Each word's share of the n-grams it is part of, toward "positive" (the model explains its label):
// an n-gram's contribution is split over its occurrences and their words.
function wordScores(tokens, explanation) {
  const scores = new Array(tokens.length).fill(0);
  const sign = explanation.label === "positive" ? 1 : -1;
  explanation.ngrams.forEach((ngram, k) => {
    const parts = ngram.split(" ");
    const at = [];
    for (let i = 0; i + parts.length <= tokens.length; i++) {
      if (parts.every((part, j) => tokens[i + j].word === part)) at.push(i);
    }
    const share = (sign * explanation.contributions[k]) / (at.length * parts.length);
    for (const i of at) for (let j = 0; j < parts.length; j++) scores[i + j] += share;
  });
  return scores;
}

// The review with its words marked: colour (blue for positive, orange for negative, stronger with
// the weight) and, for readers without colour, a solid underline for positive and a dashed one for
// negative, thicker for the stronger half, plus the exact value on hover and for screen readers.
function highlight(paragraph, text, explanation) {
  const tokens = words(text);
  const scores = wordScores(tokens, explanation);
  const strongest = Math.max(...scores.map(Math.abs), 1e-9);
  const parts = [];
  let last = 0;
  tokens.forEach((token, i) => {
    const weight = scores[i] / strongest;
    if (Math.abs(weight) < 0.05) return;
    parts.push(document.createTextNode(text.slice(last, token.start)));
    const mark = document.createElement("mark");
    mark.className = `${weight > 0 ? "pro" : "con"}${Math.abs(weight) >= 0.5 ? " strong" : ""}`;
    mark.style.setProperty("--weight", Math.abs(weight).toFixed(2));
    mark.textContent = text.slice(token.start, token.end);
    const what = `${scores[i] > 0 ? "+" : ""}${scores[i].toFixed(2)} toward positive`;
    mark.title = what;
    mark.setAttribute("aria-label", `${mark.textContent} (${what})`);
    parts.push(mark);
    last = token.end;
  });
  parts.push(document.createTextNode(text.slice(last)));
  paragraph.replaceChildren(...parts);
  paragraph.classList.add("explained");
}

async function explain(items, texts) {
  try {
    const { body } = await api(`v1/models/${encodeURIComponent(MODEL)}:explain`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ instances: texts }),
    });
    body.predictions.forEach((explanation, i) => highlight(items[i].querySelector(".text"), texts[i], explanation));
    $("legend").hidden = false;
  } catch (err) {
    $("legend").hidden = true;
    $("results-meta").textContent += ` (no explanation: ${err.message})`;
  }
}

// after an error: don't leave old results looking like answers to the new input
function clearResults() {
  $("results").replaceChildren();
  $("legend").hidden = true;
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
    const items = body.map((result, i) => renderResult(texts[i], result));
    $("legend").hidden = true;
    $("results").replaceChildren(...items);
    const version = response.headers.get("X-Model-Version");
    const ms = Math.round(performance.now() - started);
    $("results-meta").textContent =
      `· ${texts.length} review${texts.length === 1 ? "" : "s"}${version ? `, version ${version}` : ""}, ${ms} ms`;
    await explain(items, texts);
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
