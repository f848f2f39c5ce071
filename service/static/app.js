// lapguard's page: uses only the public API (/v1/model, /v1/explain, /v1/gallery, /v1/stats).
"use strict";

const KEY_STORE = "lapguard-api-key";
const state = { key: sessionStorage.getItem(KEY_STORE) || "", keyWaiters: [] };
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

// ---- API -----------------------------------------------------------------------------------
class KeyNeeded extends Error {}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (state.key) headers.set("X-API-Key", state.key);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askForKey(await errorText(response));
    throw new KeyNeeded("an API key is needed");
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const error = body.error;
    if (typeof error === "string") return error;
    if (error && error.message) return error.message;
    return JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

function askForKey(message) {
  $("key-panel").hidden = false;
  $("key-message").textContent = state.key
    ? `The server refused the key: ${message}`
    : `This server requires an API key: ${message}`;
  $("key-input").focus();
}

function onKey(event) {
  event.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-panel").hidden = true;
  loadGallery();
  pollStats();
}

// ---- the served bundle ---------------------------------------------------------------------
const HEADLINES = ["test_accuracy", "heldout_fpr", "seen_detection_accuracy_mean", "seen_auroc_mean"];

async function loadModel() {
  let model;
  try {
    const response = await fetch("/v1/model");
    if (!response.ok) throw new Error(await errorText(response));
    model = await response.json();
  } catch (error) {
    $("model-info").textContent = `not available: ${error.message}`;
    return;
  }
  const rows = [
    ["bundle", `${model.name} · version ${model.version}`],
    ["dataset", model.dataset || "?"],
    ["detector", model.detector ? model.detector.kind : "?"],
    ["threshold", `${fmt(model.threshold)} (target FPR ${pct(model.target_fpr)})`],
  ];
  for (const name of HEADLINES) {
    if (model.metrics && name in model.metrics) rows.push([name.replaceAll("_", " "), fmt(model.metrics[name])]);
  }
  const list = el("dl", { id: "model-list", "data-version": model.version, "data-name": model.name });
  for (const [term, value] of rows) list.append(el("dt", {}, term), el("dd", {}, value));
  $("model-info").replaceChildren(list);
  showBuilding(model.building);
}

function showBuilding(building) {
  const box = $("building");
  if (!building) {
    box.hidden = true;
    return;
  }
  box.hidden = false;
  const done = Number(building.done || 0);
  const total = Math.max(1, Number(building.total || 1));
  const text = building.state === "failed"
    ? `building ${building.preset}: failed (${building.message || "see its log"})`
    : building.state === "done"
      ? `${building.preset} is built`
      : `building ${building.preset}: step ${done}/${total} (${building.step || "…"})`;
  const bar = el("progress", { max: String(total), value: String(done) });
  box.replaceChildren(el("span", {}, text), bar);
}

// ---- scoring images --------------------------------------------------------------------------
async function explainFile(file) {
  const card = el("article", { class: "result pending", "data-testid": "result" });
  card.append(el("h3", {}, file.name || "image"), el("p", { class: "status" }, "scoring…"));
  $("results").prepend(card);
  const body = new FormData();
  body.append("files", file, file.name || "image.png");
  let response;
  try {
    response = await api("/v1/explain", { method: "POST", body });
  } catch (error) {
    return showError(card, error instanceof KeyNeeded ? "An API key is needed: enter it above and try again." : error.message);
  }
  if (!response.ok) return showError(card, await errorText(response), response.status);
  const answer = await response.json();
  showResult(card, file, answer, answer.results[0]);
}

function showError(card, message, status) {
  card.className = "result refused";
  card.dataset.status = String(status || "");
  card.querySelector(".status").replaceChildren(
    el("strong", {}, status ? `Refused (${status}): ` : "Failed: "),
    document.createTextNode(message),
  );
}

function showResult(card, file, answer, result) {
  card.className = `result ${result.flagged ? "flagged" : "passed"}`;
  Object.assign(card.dataset, {
    flagged: String(result.flagged),
    label: result.class_name,
    score: String(result.score),
    threshold: String(result.threshold),
    queryAttack: String(result.query_attack),
  });
  const image = el("img", { src: URL.createObjectURL(file), alt: file.name || "input" });
  const verdict = el("p", { class: "verdict" }, result.flagged ? "FLAGGED" : "not flagged");
  const label = el("p", { class: "label" }, `${result.class_name} · ${pct(result.confidence)} confidence`);
  const score = scoreBar(result.score, result.threshold);
  const notes = [];
  if (result.query_attack) notes.push(el("p", { class: "warning" }, "This client's recent queries look like a query-based attack."));
  const outside = result.explanation.outside;
  const where = result.explanation.band
    ? (outside.length ? `outside the clean band at ${outside.map((m) => answer.blocks[m]).join(", ")}` : "inside the clean band at every block")
    : "this bundle has no clean band";
  const charts = el("div", { class: "charts" },
    chart("msq = ‖r‖²/d (log)", answer.blocks, result.explanation, "msq", true),
    chart("cos(r, 1)", answer.blocks, result.explanation, "cos", false));
  const side = el("div", { class: "summary" }, verdict, label, score, el("p", { class: "where" }, where), ...notes);
  card.querySelector(".status").replaceWith(el("div", { class: "body" }, image, side, charts));
}

function scoreBar(score, threshold) {
  const low = Math.min(0, score, threshold);
  const high = Math.max(score, threshold) * 1.25 || 1;
  const at = (v) => `${(100 * (v - low)) / (high - low)}%`;
  const fill = el("span", { class: "fill" });
  const mark = el("span", { class: "threshold" });
  fill.style.width = at(score); // CSSOM, not a style attribute: the page's CSP forbids those
  mark.style.left = at(threshold);
  const bar = el("div", { class: "score-bar" }, fill, mark);
  return el("div", { class: "score" }, el("span", {}, `score ${fmt(score)} vs threshold ${fmt(threshold)}`), bar);
}

// ---- the per-block chart: the input over its class's clean band -------------------------------
function chart(title, blocks, explanation, feature, logScale) {
  const W = 300, H = 150, PAD = { left: 44, right: 8, top: 18, bottom: 22 };
  const value = (v) => (logScale ? Math.log10(Math.max(v, 1e-12)) : v);
  const input = explanation[feature].map(value);
  const band = explanation.band ? explanation.band[feature].map((row) => row.map(value)) : null;
  const all = input.concat(band ? band.flat() : []).filter(Number.isFinite);
  let [lo, hi] = [Math.min(...all), Math.max(...all)];
  if (hi - lo < 1e-9) [lo, hi] = [lo - 1, hi + 1];
  const pad = (hi - lo) * 0.08;
  [lo, hi] = [lo - pad, hi + pad];
  const x = (m) => PAD.left + ((W - PAD.left - PAD.right) * (blocks.length === 1 ? 0.5 : m / (blocks.length - 1)));
  const y = (v) => PAD.top + ((H - PAD.top - PAD.bottom) * (hi - v)) / (hi - lo);
  const svg = svgEl("svg", { class: `chart chart-${feature}`, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  svg.append(svgEl("text", { x: PAD.left, y: 12, class: "title" }, title));
  if (band) {
    const area = (upper, lower) => upper.map((v, m) => `${x(m)},${y(v)}`).concat(lower.map((v, m) => `${x(m)},${y(v)}`).reverse()).join(" ");
    const last = band.length - 1;
    svg.append(svgEl("polygon", { class: "band-outer", points: area(band[last], band[0]) }));
    if (band.length >= 4) svg.append(svgEl("polygon", { class: "band-inner", points: area(band[last - 1], band[1]) }));
    svg.append(svgEl("polyline", { class: "band-median", points: band[Math.floor(band.length / 2)].map((v, m) => `${x(m)},${y(v)}`).join(" ") }));
  }
  svg.append(svgEl("polyline", { class: "input-line", points: input.map((v, m) => `${x(m)},${y(v)}`).join(" ") }));
  input.forEach((v, m) => {
    const out = explanation.outside.includes(m);
    const dot = svgEl("circle", { cx: x(m), cy: y(v), r: out ? 4 : 2.5, class: out ? "point outside" : "point" });
    dot.append(svgEl("title", {}, `${blocks[m]}: ${fmt(explanation[feature][m])}`));
    svg.append(dot);
  });
  for (const v of [lo + pad, hi - pad]) {
    svg.append(svgEl("text", { x: PAD.left - 4, y: y(v) + 3, class: "axis", "text-anchor": "end" }, logScale ? fmt(10 ** v) : v.toFixed(2)));
  }
  svg.append(svgEl("text", { x: (W + PAD.left) / 2, y: H - 6, class: "axis", "text-anchor": "middle" }, `block 0 … ${blocks.length - 1}`));
  return svg;
}

// ---- the gallery ---------------------------------------------------------------------------
async function loadGallery() {
  let samples;
  try {
    const response = await api("/v1/gallery");
    if (!response.ok) throw new Error(await errorText(response));
    samples = (await response.json()).samples;
  } catch (error) {
    if (!(error instanceof KeyNeeded)) $("gallery").textContent = `no gallery: ${error.message}`;
    return;
  }
  if (!samples.length) {
    $("gallery-panel").hidden = true;
    return;
  }
  const buttons = await Promise.all(samples.map(galleryButton));
  $("gallery").replaceChildren(...buttons.filter(Boolean));
}

async function galleryButton(sample) {
  const response = await api(sample.url);
  if (!response.ok) return null;
  const blob = await response.blob();
  const file = new File([blob], sample.name, { type: "image/png" });
  const caption = sample.kind === "clean" ? `clean ${sample.label}` : `${sample.kind}: ${sample.source}`;
  const button = el("button", { type: "button", class: `sample ${sample.kind}`, title: sample.name, "data-name": sample.name, "data-kind": sample.kind },
    el("img", { src: URL.createObjectURL(blob), alt: sample.name }), el("span", {}, caption));
  button.addEventListener("click", () => explainFile(file));
  return button;
}

// ---- the live panel --------------------------------------------------------------------------
let statsTimer = null;

async function pollStats() {
  clearTimeout(statsTimer);
  try {
    const response = await api("/v1/stats?window_s=300&bucket_s=10");
    if (response.ok) showStats(await response.json());
  } catch (error) {
    if (error instanceof KeyNeeded) return; // resumes once a key is entered
  }
  statsTimer = setTimeout(pollStats, 3000);
}

function showStats(stats) {
  $("live-numbers").replaceChildren(
    el("span", { id: "live-requests", "data-requests": String(stats.requests) }, `${stats.requests} requests (${stats.request_rate.toFixed(2)}/s)`),
    el("span", {}, `${stats.images} images`),
    el("span", {}, `flag rate ${stats.flag_rate === null ? "–" : pct(stats.flag_rate)}`));
  $("live-rate").replaceChildren(bars(stats.buckets.map((b) => b.requests), stats.buckets.map((b) => b.flagged)));
  const h = stats.histogram;
  const threshold = h.edges.length && stats.threshold !== null
    ? (stats.threshold - h.edges[0]) / (h.edges[h.edges.length - 1] - h.edges[0]) : null;
  $("live-histogram").replaceChildren(bars(h.counts, h.flagged, threshold));
}

function bars(counts, flagged, marker = null) {
  const W = 300, H = 80;
  const svg = svgEl("svg", { class: "bars", viewBox: `0 0 ${W} ${H}` });
  const top = Math.max(1, ...counts);
  const step = W / Math.max(1, counts.length);
  counts.forEach((c, i) => {
    const h = (H - 4) * (c / top), f = (H - 4) * ((flagged[i] || 0) / top);
    svg.append(svgEl("rect", { x: i * step + 1, y: H - h, width: Math.max(1, step - 2), height: h, class: "bar" }));
    if (f > 0) svg.append(svgEl("rect", { x: i * step + 1, y: H - f, width: Math.max(1, step - 2), height: f, class: "bar flagged" }));
  });
  if (marker !== null && marker >= 0 && marker <= 1) svg.append(svgEl("line", { x1: marker * W, x2: marker * W, y1: 0, y2: H, class: "marker" }));
  return svg;
}

// ---- helpers -------------------------------------------------------------------------------
function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function svgEl(tag, attributes = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmt = (v) => (typeof v === "number" ? (Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toExponential(2) : v.toFixed(3)) : String(v));
const pct = (v) => (typeof v === "number" ? `${(100 * v).toFixed(1)}%` : "?");

// ---- start ---------------------------------------------------------------------------------
function start() {
  $("key-form").addEventListener("submit", onKey);
  const input = $("file-input");
  input.addEventListener("change", () => {
    for (const file of input.files) explainFile(file);
    input.value = "";
  });
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    for (const file of event.dataTransfer.files) explainFile(file);
  });
  loadModel();
  setInterval(loadModel, 5000);
  loadGallery();
  pollStats();
}

document.addEventListener("DOMContentLoaded", start);
