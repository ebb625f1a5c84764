// The tsukimi dashboard (dashboard.html): one GET of /dashboard/api/snapshot for the history,
// then one `snapshot` server-sent event per interval from /dashboard/api/events (the stream
// ends every few seconds and EventSource reconnects by itself). Text goes in with textContent
// only: worker names and request ids come from outside.
"use strict";

const MAX_POINTS = 600;
const $ = (id) => document.getElementById(id);
const fmtInt = (n) => Number(n).toLocaleString("en-US");
const fmtPct = (x) => (100 * x).toFixed(1) + " %";
const fmtMs = (s) => (s === null || s === undefined ? "-" : (1000 * s).toFixed(1) + " ms");
const ms = (s) => (s === null || s === undefined ? null : 1000 * s);
const POINT = { wall: 0, ttft50: 1, ttft90: 2, ttft99: 3, tbt50: 4, tbt90: 5, tbt99: 6, rps: 7, tps: 8 };

let points = [];      // Point arrays, oldest first
let charts = null;
let lastSeq = -1;
let lastWall = 0;

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  if (cls === "trunc") td.title = text;
  row.appendChild(td);
  return td;
}

function bar(row, used, total, label) {
  const td = document.createElement("td");
  const outer = document.createElement("div");
  outer.className = "bar";
  const fill = document.createElement("div");
  fill.style.width = total > 0 ? Math.min(100, (100 * used) / total).toFixed(1) + "%" : "0%";
  const text = document.createElement("span");
  text.textContent = label;
  outer.append(fill, text);
  td.appendChild(outer);
  row.appendChild(td);
}

function fill(tbody, items, render, empty, columns) {
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    render(tr, item);
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = cell(tr, empty, "empty");
    td.colSpan = columns;
    rows.push(tr);
  }
  tbody.replaceChildren(...rows);
}

function size(bytes) {
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, scale] of units) if (bytes >= scale) return (bytes / scale).toFixed(1) + " " + unit;
  return bytes + " B";
}

function renderWorkers(snap) {
  const workers = [...snap.workers].sort((a, b) => (a.role + a.name).localeCompare(b.role + b.name));
  fill($("workers").tBodies[0], workers, (tr, w) => {
    tr.dataset.worker = w.name;
    cell(tr, w.name);
    cell(tr, w.role);
    cell(tr, w.healthy ? "up" : "DOWN", w.healthy ? "up" : "down");
    cell(tr, fmtInt(w.waiting), "num");
    cell(tr, fmtInt(w.running), "num");
    cell(tr, fmtInt(w.in_flight), "num");
    cell(tr, fmtInt(w.requests), "num");
    bar(tr, w.used_blocks, w.total_blocks, `${fmtInt(w.used_blocks)} / ${fmtInt(w.total_blocks)} (${fmtInt(w.free_blocks)} free)`);
  }, "no workers", 8);
}

function renderStore(snap) {
  const store = snap.store;
  $("store-master").textContent = store.master ? "at " + store.master : "";
  $("store-error").textContent = store.error || "";
  const stats = $("store-stats");
  stats.replaceChildren();
  for (const [name, value] of Object.entries(store.stats)) {
    const b = document.createElement("b");
    b.textContent = fmtInt(value);
    stats.append(name.replace(/_/g, " ") + " ", b);
  }
  const empty = store.master ? "no segment mounted" : "no master: colocated mode, or the router has no --master";
  fill($("segments").tBodies[0], store.segments, (tr, s) => {
    cell(tr, s.segment_id, "trunc");
    cell(tr, s.client_id, "trunc");
    cell(tr, s.healthy ? "up" : "down", s.healthy ? "up" : "down");
    bar(tr, s.used_bytes, s.capacity_bytes, `${size(s.used_bytes)} / ${size(s.capacity_bytes)}`);
  }, empty, 4);
}

function renderTotals(snap) {
  const t = snap.totals;
  $("requests-ok").textContent = fmtInt(t.requests_ok);
  $("requests-failed").textContent = fmtInt(t.requests_failed);
  $("prompt-tokens").textContent = fmtInt(t.prompt_tokens);
  $("completion-tokens").textContent = fmtInt(t.completion_tokens);
  $("hit-ratio").textContent = fmtPct(t.hit_ratio);
  $("pool-ratio").textContent = fmtPct(t.pool_ratio);
  const last = points[points.length - 1];
  $("tokens-per-s").textContent = last ? last[POINT.tps].toFixed(1) : "-";
  const lat = snap.latency;
  $("latency-window").textContent = `(last ${lat.window_s} s, ${lat.samples} requests)`;
  ["p50", "p90", "p99"].forEach((q, i) => {
    $("ttft-" + q).textContent = fmtMs(lat.ttft_s[i]);
    $("tbt-" + q).textContent = fmtMs(lat.tbt_s[i]);
  });
  const reasons = Object.entries(snap.rejections).sort();
  fill($("rejections").tBodies[0], reasons, (tr, [reason, n]) => {
    cell(tr, reason, "rejected");
    cell(tr, fmtInt(n), "num");
  }, "none", 2);
}

function renderDecisions(snap) {
  $("decisions-total").textContent = `(${fmtInt(snap.decisions_total)} in all, newest first)`;
  fill($("decisions").tBodies[0], snap.decisions, (tr, d) => {
    tr.dataset.seq = d.seq;
    cell(tr, String(d.seq), "num");
    cell(tr, Math.max(0, snap.clock_s - d.time_s).toFixed(1) + " s", "num");
    cell(tr, d.request_id, "trunc");
    cell(tr, fmtInt(d.prompt_tokens), "num");
    cell(tr, d.prefill || "-", "worker");
    cell(tr, d.decode || "-");
    cell(tr, d.expected_cached_tokens === null ? "-" : fmtInt(d.expected_cached_tokens), "num");
    cell(tr, d.cached_tokens === null ? "-" : fmtInt(d.cached_tokens), "num");
    cell(tr, d.predicted_ttft_s === null ? "-" : fmtMs(d.predicted_ttft_s), "num");
    const outcome = d.accepted ? (d.queued ? "accepted, queued for KV memory" : "accepted") : "rejected: " + d.reason;
    cell(tr, outcome, d.accepted ? "" : "rejected");
  }, "no request yet", 10);
}

function chart(el, series, yLabel) {
  const opts = {
    width: Math.max(300, el.clientWidth), height: 220, legend: { live: true },
    scales: { x: { time: true } },
    axes: [{}, { label: yLabel, size: 60 }],
    series: [{}, ...series.map(([label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: true,
      value: (u, v) => (v === null || v === undefined ? "-" : v.toFixed(1)) }))],
  };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

function chartData() {
  const col = (i, f) => points.map((p) => f(p[i]));
  const id = (v) => v;
  return {
    ttft: [col(POINT.wall, id), col(POINT.ttft50, ms), col(POINT.ttft90, ms), col(POINT.ttft99, ms)],
    tbt: [col(POINT.wall, id), col(POINT.tbt50, ms), col(POINT.tbt90, ms), col(POINT.tbt99, ms)],
    rate: [col(POINT.wall, id), col(POINT.tps, id), col(POINT.rps, id)],
  };
}

function renderCharts() {
  if (typeof uPlot === "undefined") return;
  if (!charts) {
    const q = [["p50", "#2f9e44"], ["p90", "#f08c00"], ["p99", "#e03131"]];
    charts = {
      ttft: chart($("chart-ttft"), q, "ms"),
      tbt: chart($("chart-tbt"), q, "ms"),
      rate: chart($("chart-rate"), [["tokens/s", "#3b5bdb"], ["requests/s", "#ae3ec9"]], "per second"),
    };
    window.addEventListener("resize", () => {
      for (const [name, c] of Object.entries(charts)) c.setSize({ width: Math.max(300, $("chart-" + name).clientWidth), height: 220 });
    });
  }
  const data = chartData();
  for (const [name, c] of Object.entries(charts)) c.setData(data[name]);
}

function apply(snap, fullSeries) {
  if (snap.seq === lastSeq) return;
  lastSeq = snap.seq;
  if (fullSeries) points = snap.series.slice(-MAX_POINTS);
  else for (const p of snap.series) if (!points.length || p[POINT.wall] > points[points.length - 1][POINT.wall]) points.push(p);
  if (points.length > MAX_POINTS) points = points.slice(-MAX_POINTS);
  lastWall = snap.wall_s;
  $("mode").textContent = snap.mode;
  $("model").textContent = snap.model;
  $("updated").textContent = "updated " + new Date(snap.wall_s * 1000).toLocaleTimeString();
  document.body.dataset.seq = snap.seq;
  renderTotals(snap);
  renderWorkers(snap);
  renderStore(snap);
  renderDecisions(snap);
  renderCharts();
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + cls;
}

async function start() {
  try {
    const response = await fetch("/dashboard/api/snapshot", { cache: "no-store" });
    apply(await response.json(), true);
    setStatus("live", "live");
  } catch (err) {
    setStatus("router unreachable", "down");
  }
  const events = new EventSource("/dashboard/api/events");
  events.addEventListener("snapshot", (e) => {
    apply(JSON.parse(e.data), false);
    setStatus("live", "live");
  });
  events.onerror = () => {
    // NOTE: every stream ends after a few seconds by design; only a long silence means trouble
    if (Date.now() / 1000 - lastWall > 5) setStatus("reconnecting", "down");
  };
}

start();
