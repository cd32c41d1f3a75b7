// kvgate console: polls the gateway's admin JSON and draws it with plain DOM and SVG.
// No framework and no charting library: the page must work offline, from the wheel, with
// nothing built at install time. Everything below is written for this page.
"use strict";

const POLL_MS = 1500;
const HISTORY_S = 900;
const HOTTEST_ROWS = 7;
const COLORS = ["#58a6ff", "#3fb950", "#d29922", "#bc8cff", "#ff7b72", "#39c5cf", "#f778ba",
                "#a5d6ff", "#7ee787", "#e3b341", "#ffa657", "#79c0ff"];
const HEALTH_COLORS = {healthy: "#3fb950", half_open: "#d29922", ejected: "#f85149"};
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {history: [], lastT: 0, colors: new Map(), failures: 0};

// ---- credentials: an admin key given as #key=... is kept for this tab, never sent in URLs
(function readKey() {
  const m = /(?:^|[#&])key=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem("kvgate-admin-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

function headers() {
  const key = sessionStorage.getItem("kvgate-admin-key");
  return key ? {Authorization: "Bearer " + key} : {};
}

async function getJSON(path) {
  const resp = await fetch(path, {headers: headers(), cache: "no-store"});
  if (!resp.ok) {
    throw new Error(path + " answered " + resp.status);
  }
  return resp.json();
}

// ---- formatting ---------------------------------------------------------------------
function num(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100) return v.toFixed(0);
  return v.toFixed(digits);
}
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
const ms = (v) => (v === null || v === undefined ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s");
const money = (v) => (v === null || v === undefined ? "–" : v < 0.01 ? v.toPrecision(2) : v.toFixed(3));
function clock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}
function colorOf(name) {
  if (!state.colors.has(name)) state.colors.set(name, COLORS[state.colors.size % COLORS.length]);
  return state.colors.get(name);
}

// ---- DOM helpers ----------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}
function setText(id, text) {
  document.getElementById(id).textContent = text;
}
function fill(id, nodes) {
  document.getElementById(id).replaceChildren(...nodes);
}
function meter(value) {
  const m = el("span", {class: "meter" + (value > 0.95 ? " full" : value > 0.8 ? " hot" : "")});
  const bar = el("i");
  bar.style.width = (value === null ? 0 : Math.min(100, 100 * value)) + "%";
  m.append(bar, el("span", {}, pct(value)));
  return m;
}
function chips(id, counts, empty) {
  const entries = Object.entries(counts || {}).filter(([, v]) => v);
  fill(id, entries.length
    ? entries.sort((a, b) => b[1] - a[1]).map(([k, v]) => el("span", {"data-key": k}, k, el("b", {}, num(v, 0))))
    : [el("span", {class: "empty"}, empty)]);
}

// ---- charts: SVG line charts over the kept history ------------------------------------
// The time axis spans the history the page holds (at least a minute, at most 15), so a
// freshly opened console is not a spike at the right edge of an empty chart.
function windowSpan() {
  const h = state.history;
  const span = h.length ? h[h.length - 1].t - h[0].t : 0;
  return Math.min(HISTORY_S, Math.max(60, Math.ceil(span / 60) * 60));
}
function axisMarks(span) {
  const step = span <= 120 ? 30 : span <= 300 ? 60 : span <= 600 ? 120 : 300;
  const marks = [];
  for (let s = span; s > 0; s -= step) marks.push(s);
  marks.push(0);
  return marks;
}
function ago(s) {
  if (s === 0) return "now";
  return s < 60 || s % 60 ? `-${s} s` : `-${s / 60} min`;
}
function timeAxis(root, x, now, span, y) {
  const marks = axisMarks(span);
  for (const m of marks) {
    const anchor = m === 0 ? "end" : m === span ? "start" : "middle";
    const label = svg("text", {x: x(now - m), y, "text-anchor": anchor});
    label.textContent = ago(m);
    root.append(label);
  }
}

function lineChart(id, series, opts = {}) {
  const host = document.getElementById(id);
  const width = host.clientWidth || 400;
  const height = opts.height || 150;
  const pad = {l: 48, r: 8, t: 6, b: 18};
  const now = state.history.length ? state.history[state.history.length - 1].t : Date.now() / 1000;
  const span = windowSpan();
  const t0 = now - span;
  let max = opts.max || 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
  if (!opts.max) max = max > 0 ? max * 1.15 : 1;
  const x = (t) => pad.l + ((t - t0) / span) * (width - pad.l - pad.r);
  const y = (v) => height - pad.b - (v / max) * (height - pad.t - pad.b);
  const root = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`});
  for (let i = 0; i <= 3; i++) {
    const v = (max * i) / 3;
    root.append(svg("line", {class: "grid", x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v)}));
    const label = svg("text", {x: pad.l - 4, y: y(v) + 4, "text-anchor": "end"});
    label.textContent = (opts.format || num)(v);
    root.append(label);
  }
  timeAxis(root, x, now, span, height - 4);
  for (const s of series) {
    let d = "";
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null || v === undefined || t < t0) { pen = false; continue; }
      d += (pen ? "L" : "M") + x(t).toFixed(1) + "," + y(Math.min(v, max)).toFixed(1);
      pen = true;
    }
    if (d) root.append(svg("path", {d, fill: "none", stroke: s.color, "stroke-width": s.width || 2}));
  }
  const legend = el("div", {class: "legend"},
    ...series.map((s) => el("span", {}, el("i", {style: `background:${s.color}`}), s.name)));
  host.replaceChildren(legend, root);
}

function perReplica(field) {
  const names = new Set();
  for (const s of state.history) for (const r of Object.keys(s.replicas || {})) names.add(r);
  return [...names].sort().map((name) => ({
    name, color: colorOf(name),
    points: state.history.map((s) => [s.t, s.replicas && s.replicas[name] ? s.replicas[name][field] : null]),
  }));
}
function total(field) {
  return state.history.map((s) => [s.t, s[field]]);
}

function sparkline(name) {
  const w = 150, h = 22;
  const pts = state.history.map((s) => (s.replicas && s.replicas[name] ? s.replicas[name].in_flight : null));
  const max = Math.max(1, ...pts.filter((v) => v !== null));
  const root = svg("svg", {width: w, height: h});
  let d = "";
  pts.forEach((v, i) => {
    if (v === null) return;
    const px = (i / Math.max(1, pts.length - 1)) * w;
    d += (d ? "L" : "M") + px.toFixed(1) + "," + (h - 2 - (v / max) * (h - 4)).toFixed(1);
  });
  if (d) root.append(svg("path", {d, fill: "none", stroke: colorOf(name), "stroke-width": 1.5}));
  return root;
}

// ---- panels ---------------------------------------------------------------------------
function renderFleet(f) {
  const rows = f.replicas.map((r) => {
    const queue = r.waiting === null ? "–" : `${num(r.waiting, 0)} / ${num(r.running, 0)}`;
    const tr = el("tr", {"data-replica": r.id, "data-health": r.health, class: r.health},
      el("td", {class: "id"}, el("span", {style: `color:${colorOf(r.id)}`}, "● "), r.id),
      el("td", {class: "health"}, el("span", {class: "badge " + r.health}, r.health.replace("_", "-"))),
      el("td", {class: "engine"}, r.engine),
      el("td", {class: "pool"}, r.pool || "–"),
      el("td", {class: "n inflight"}, r.in_flight),
      el("td", {class: "n queue", title: "waiting / running in the engine"}, queue),
      el("td", {class: "kv"}, meter(r.kv_usage)),
      el("td", {class: "n hit"}, pct(r.prefix_hit_rate)),
      el("td", {class: "n rps"}, num(r.requests_per_s)),
      el("td", {class: "n err" + (r.error_share > 0.05 ? " bad" : ""),
                title: r.errors_per_s === null ? "" : `${num(r.errors_per_s)} failed attempts/s`},
         pct(r.error_share)),
      el("td", {class: "n tps"}, num(r.tokens_per_s, 0)),
      el("td", {class: "n ttft50"}, ms(r.ttft_p50_s)),
      el("td", {class: "n ttft99"}, ms(r.ttft_p99_s)),
      el("td", {class: "n ring"}, pct(r.ring_share)),
      el("td", {class: "spark"}, sparkline(r.id)));
    if (r.load_stale) tr.title = "engine load is stale";
    return tr;
  });
  fill("fleet-rows", rows);
  const bad = f.replicas.length - f.healthy;
  setText("kpi-healthy", `${f.healthy} / ${f.replicas.length}`);
  document.getElementById("kpi-healthy").parentNode.classList.toggle("bad", bad > 0);
  setText("kpi-inflight", num(f.in_flight, 0));
  setText("fleet-note", f.measuring ? "" : "· tokens and TTFT start when the console is read");
  renderTimeline(f);
}

function renderTimeline(f) {
  const host = document.getElementById("timeline-bands");
  const width = host.clientWidth || 900;
  const names = f.replicas.map((r) => r.id);
  const rowH = 16, labelW = 70;
  const height = names.length * (rowH + 3) + 14;
  const now = state.history.length ? state.history[state.history.length - 1].t : f.now;
  const span = windowSpan();
  const t0 = now - span;
  const x = (t) => labelW + ((t - t0) / span) * (width - labelW - 8);
  const root = svg("svg", {width, height});
  names.forEach((name, i) => {
    const y = i * (rowH + 3);
    const label = svg("text", {x: 0, y: y + 12});
    label.textContent = name;
    root.append(label);
    root.append(svg("rect", {x: labelW, y, width: width - labelW - 8, height: rowH, fill: "#21262d"}));
    const h = state.history;
    for (let k = 0; k < h.length; k++) {
      const r = h[k].replicas && h[k].replicas[name];
      if (!r || h[k].t < t0) continue;
      const end = k + 1 < h.length ? h[k + 1].t : h[k].t + f.sample_interval_s;
      root.append(svg("rect", {x: x(h[k].t), y, width: Math.max(1, x(end) - x(h[k].t) + 0.5),
                               height: rowH, fill: HEALTH_COLORS[r.health] || "#30363d"}));
    }
  });
  for (const e of f.events) {
    const row = names.indexOf(e.subject);
    if (row < 0 || e.at < t0) continue;
    const y = row * (rowH + 3);
    root.append(svg("line", {x1: x(e.at), x2: x(e.at), y1: y - 1, y2: y + rowH + 1,
                             stroke: "#fff", "stroke-width": 2}));
  }
  timeAxis(root, x, now, span, height - 2);
  host.replaceChildren(root);
  const recent = f.events.slice(-12).reverse();
  fill("timeline-events", recent.length
    ? recent.map((e) => el("li", {"data-kind": e.kind,
                                  title: e.kind + " " + e.subject + (e.detail ? " · " + e.detail : "")},
        clock(e.at) + " ",
        el("b", {class: e.kind}, e.kind.replace("_", "-")), " " + e.subject + (e.detail ? " · " + e.detail : "")))
    : [el("li", {class: "empty"}, "no ejections or re-admissions in the last 15 minutes")]);
}

function renderSessions(s) {
  setText("sessions-live", s.measuring ? num(s.live, 0) : "–");
  setText("kpi-live", s.measuring ? num(s.live, 0) : "–");
  setText("sessions-tracked", num(s.tracked, 0));
  const moved = Object.values(s.moves).reduce((a, b) => a + b, 0);
  setText("sessions-moves", num(moved, 0));
  setText("sessions-lineage", s.lineage ? `${num(s.lineage.conversations, 0)}` : "off");
  document.getElementById("sessions-lineage").title = s.lineage
    ? `${s.lineage.blocks} of ${s.lineage.capacity_blocks} prefix hashes` : "lineage is off";
  setText("sessions-note", `live = seen in the last ${Math.round(s.live_window_s / 60)} min`);
  const max = Math.max(1, ...Object.values(s.spread));
  fill("sessions-spread", Object.entries(s.spread).sort().map(([rid, n]) => {
    const bar = el("i");
    bar.style.width = (100 * n) / max + "%";
    bar.style.background = colorOf(rid);
    return el("div", {class: "bar", "data-replica": rid}, el("label", {}, rid), el("div", {}, bar), el("b", {}, n));
  }));
  chips("sessions-why", s.moves, "no session moved");
  chips("sessions-decisions", s.routing_decisions, "no decisions yet");
  fill("hottest-rows", s.hottest.length ? s.hottest.slice(0, HOTTEST_ROWS).map((h) => el("tr", {"data-key": h.key},
    el("td", {title: h.source + ": " + h.key}, h.key), el("td", {}, h.replica),
    el("td", {class: "n"}, h.requests), el("td", {class: "n"}, num(h.tokens, 0)), el("td", {class: "n"}, h.moves)))
    : [el("tr", {}, el("td", {class: "empty", colSpan: 5}, s.measuring ? "no live sessions" : "measuring starts now"))]);
}

function renderTraffic(t) {
  setText("traffic-rps", num(t.requests_per_s));
  setText("kpi-rps", num(t.requests_per_s));
  setText("traffic-tps", num(t.tokens_per_s, 0));
  setText("traffic-out", num(t.output_tokens_per_s, 0));
  setText("kpi-tps", num(t.tokens_per_s, 0));
  setText("kpi-tps-out", t.output_tokens_per_s === null ? "tokens/s" : `tokens/s · ${num(t.output_tokens_per_s, 0)} output`);
  setText("traffic-cached", pct(t.cached_share === null ? t.cached_share_total : t.cached_share));
  setText("kpi-cached", pct(t.cached_share === null ? t.cached_share_total : t.cached_share));
  const f = t.cache_forecast;
  // Cached tokens the engines reported / those the router predicted (since start).
  setText("traffic-forecast", f ? `${num(f.achieved_tokens, 0)} / ${num(f.predicted_tokens, 0)}` : "–");
  setText("traffic-note", t.measuring_since ? "tokens measured since " + clock(t.measuring_since) : "");
  const m = t.money;
  if (!m) {
    fill("money-rows", [el("tr", {}, el("td", {class: "empty", colSpan: 6},
      "no prices: set pools.pools[].price_per_card_hour, or replicas[].price_per_hour, to see cost per 1K tokens"))]);
    setText("money-reason", "");
    return;
  }
  const names = Object.keys(m.pools).filter((p) => p !== "all").sort().concat(["all"]);
  fill("money-rows", names.map((p) => {
    const c = m.pools[p];
    return el("tr", {"data-pool": p},
      el("td", {}, p === "all" ? "overall" : p),
      el("td", {class: "n"}, p === "all" ? "" : pct(m.weights[p])),
      el("td", {class: "n"}, num(c.tokens_per_s, 0)),
      el("td", {class: "n per1k"}, money(c.per_1k_total.busy)),
      el("td", {class: "n per1kout"}, money(c.per_1k_output.busy)),
      el("td", {class: "n"}, money(c.cost.busy)));
  }));
  setText("money-reason", `controller: ${m.last_change.reason} (${m.last_change.code}) · now: ${m.status}`);
}

function renderAdmission(a) {
  setText("admission-note", a.enabled ? `queue ≤ ${a.max_queue}, wait ≤ ${a.max_wait_s} s` : "off");
  setText("kpi-queued", a.enabled ? num(a.queued, 0) : "–");
  setText("kpi-429", a.enabled ? num(a.rejected_per_s) : "–");
  fill("admission-rows", a.classes.length ? a.classes.map((c) => el("tr", {"data-class": c.name},
    el("td", {}, c.name), el("td", {class: "n queued"}, c.queued), el("td", {class: "n waits"}, c.waits),
    el("td", {class: "n"}, ms(c.mean_wait_s)), el("td", {class: "n full"}, c.rejected.queue_full),
    el("td", {class: "n timeout"}, c.rejected.timeout)))
    : [el("tr", {}, el("td", {class: "empty", colSpan: 6}, "admission control is not enabled"))]);
}

function renderPD(p) {
  setText("pd-note", p.enabled ? "decisions by reason" : "off");
  fill("pd-rows", p.decisions.length ? p.decisions.map((d) => el("tr", {"data-reason": d.decision + "/" + d.reason},
    el("td", {}, d.decision), el("td", {}, d.reason), el("td", {class: "n count"}, d.count),
    el("td", {class: "n"}, num(d.per_s))))
    : [el("tr", {}, el("td", {class: "empty", colSpan: 4}, p.enabled ? "no decisions yet" : "prefill/decode disaggregation is not enabled"))]);
  const handoffs = {};
  for (const h of p.handoffs) handoffs[`${h.protocol} ${h.outcome}`] = h.count;
  chips("pd-handoffs", handoffs, p.enabled ? "no hand-offs yet" : "");
}

function renderCharts() {
  lineChart("chart-rps", [
    {name: "requests/s", color: "#58a6ff", points: total("requests_per_s")},
    {name: "errors/s", color: "#f85149", points: total("errors_per_s")},
    {name: "429/s", color: "#d29922", points: total("rejected_per_s")},
  ]);
  lineChart("chart-tps", [
    {name: "total", color: "#58a6ff", points: total("tokens_per_s")},
    {name: "output", color: "#3fb950", points: total("output_tokens_per_s")},
  ]);
  lineChart("chart-kv", perReplica("kv"), {max: 1, format: pct});
  lineChart("chart-ttft", perReplica("ttft_p50"), {format: ms});
  const pools = new Set();
  for (const s of state.history) for (const p of Object.keys(s.weights || {})) pools.add(p);
  lineChart("chart-weights", [...pools].sort().map((p) => ({name: p, color: colorOf("pool:" + p),
    points: state.history.map((s) => [s.t, s.weights ? s.weights[p] : null])})), {max: 1, format: pct, height: 110});
  const classes = new Set();
  for (const s of state.history) for (const c of Object.keys(s.queued || {})) classes.add(c);
  lineChart("chart-queue", [...classes].sort().map((c) => ({name: c, color: colorOf("class:" + c),
    points: state.history.map((s) => [s.t, s.queued ? s.queued[c] ?? null : null])})), {height: 80});
}

// ---- the poll loop --------------------------------------------------------------------
async function tick() {
  const status = document.querySelector(".status");
  try {
    const [fleet, sessions, traffic, admission, pd, history] = await Promise.all([
      getJSON("/admin/fleet"), getJSON("/admin/sessions"), getJSON("/admin/traffic"),
      getJSON("/admin/admission"), getJSON("/admin/pd"), getJSON("/admin/history?since=" + state.lastT),
    ]);
    for (const s of history) state.history.push(s);
    if (history.length) state.lastT = history[history.length - 1].t;
    const cutoff = state.lastT - HISTORY_S;
    while (state.history.length && state.history[0].t < cutoff) state.history.shift();
    renderCharts();
    renderFleet(fleet);
    renderSessions(sessions);
    renderTraffic(traffic);
    renderAdmission(admission);
    renderPD(pd);
    state.failures = 0;
    status.className = "status ok";
    setText("status-text", "live · " + clock(fleet.now));
    document.body.dataset.updated = String(fleet.now);
  } catch (err) {
    state.failures += 1;
    status.className = "status bad";
    setText("status-text", "no answer from the gateway (" + err.message + ")");
  } finally {
    setTimeout(tick, POLL_MS);
  }
}

tick();
