// The wedlm-cluster console: plain JavaScript, no build step, no CDN.
// Cluster view: /console/events (server-sent events read with fetch(), which can send the
// Bearer key; EventSource cannot). Chat view: /v1/chat/completions, streamed, with
// "stream_commits": true so that every chunk says how many forwards committed it.
"use strict";

const KEY_NAME = "wedlm-console-key";
const PALETTE = ["#60a5fa", "#f59e0b", "#34d399", "#f472b6", "#a78bfa", "#22d3ee",
                 "#fb923c", "#a3e635", "#e879f9", "#fcd34d"];
const $ = (id) => document.getElementById(id);
const state = { snapshot: null, colors: {}, events: null, chat: [], running: null,
                skew: 0, open: new Set() };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.setAttribute("style", v);
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// ---- the key -------------------------------------------------------------------------
function key() { return sessionStorage.getItem(KEY_NAME) || ""; }
function headers(extra = {}) {
  const h = { ...extra };
  if (key()) h.Authorization = `Bearer ${key()}`;
  return h;
}
function askForKey(message) {
  if (state.events) state.events.abort();
  $("main").hidden = true;
  $("key-dialog").hidden = false;
  $("key-error").textContent = message || "";
  $("state").textContent = "key needed";
  $("state").className = "badge";
  $("key-input").focus();
}
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_NAME, $("key-input").value.trim());
  $("key-input").value = "";
  connect();
});
$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_NAME);
  askForKey("");
});

// ---- tabs ----------------------------------------------------------------------------
const TABS = ["cluster", "chat"];
function show(name) {
  for (const t of TABS) {
    const on = t === name;
    $(`tab-${t}`).setAttribute("aria-selected", on);
    $(`tab-${t}`).tabIndex = on ? 0 : -1;
    $(`view-${t}`).hidden = !on;
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  if (name === "chat") $("prompt").focus();
}
for (const t of TABS) $(`tab-${t}`).addEventListener("click", () => show(t));
document.querySelector(".tabs").addEventListener("keydown", (e) => {
  if (e.key !== "ArrowLeft" && e.key !== "ArrowRight") return;
  const next = TABS[(TABS.indexOf(location.hash.slice(1) || "cluster") + 1) % TABS.length];
  show(next);
  $(`tab-${next}`).focus();
});

// ---- server-sent events over fetch ----------------------------------------------------
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function connect() {
  if (state.events) state.events.abort();
  const control = new AbortController();
  state.events = control;
  let response;
  try {
    response = await fetch("/console/events", { headers: headers(), signal: control.signal });
  } catch (err) {
    if (control.signal.aborted) return;
    return retry(control, "disconnected");
  }
  if (response.status === 401) {
    const body = await response.json().catch(() => ({}));
    return askForKey(key() ? (body.error?.message || "That key was refused.") : "");
  }
  if (!response.ok) return retry(control, `error ${response.status}`);
  $("key-dialog").hidden = true;
  $("main").hidden = false;
  $("forget-key").hidden = !key();
  try {
    for await (const data of sse(response)) render(JSON.parse(data));
  } catch (err) {
    if (control.signal.aborted) return;
  }
  retry(control, "disconnected");
}
function retry(control, why) {
  if (state.events !== control) return;
  $("state").textContent = `${why}; retrying`;
  $("state").className = "badge failed";
  setTimeout(() => { if (state.events === control) connect(); }, 2000);
}

// ---- the cluster view -------------------------------------------------------------------
function colorOf(id) {
  if (!(id in state.colors)) {
    state.colors[id] = PALETTE[Object.keys(state.colors).length % PALETTE.length];
  }
  return state.colors[id];
}
const gib = (b) => (b / 2 ** 30).toFixed(1);
// the server's clock now: its times (a loss, a snapshot) are on it, and a browser on
// another machine may be seconds off
const serverNow = () => Date.now() / 1000 + state.skew;
const ago = (t) => {
  const s = Math.max(0, serverNow() - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
};
// an age that counts up every second, between snapshots too
function age(prefix, t) {
  return el("span", { class: "age", "data-since": t, "data-prefix": prefix }, `${prefix} ${ago(t)}`);
}
setInterval(() => {
  for (const node of document.querySelectorAll(".age")) {
    node.textContent = `${node.dataset.prefix} ${ago(Number(node.dataset.since))}`;
  }
}, 1000);

// a human message, the raw error behind a toggle that stays open across snapshots
function explained(cls, text, raw, key) {
  const p = el("p", { class: cls }, text);
  if (!raw) return p;
  const toggle = el("details", { class: "raw", open: state.open.has(key) },
    el("summary", { text: "details" }), el("code", { text: raw }));
  toggle.addEventListener("toggle", () => {
    if (toggle.open) state.open.add(key); else state.open.delete(key);
  });
  return el("div", { class: `${cls}-box` }, p, toggle);
}
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const fmt = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function render(snap) {
  state.snapshot = snap;
  state.skew = snap.time - Date.now() / 1000;
  $("model").textContent = `${snap.model} · ${snap.num_layers} layers`;
  $("state").textContent = snap.state;
  $("state").className = `badge ${snap.state}`;
  $("notice").hidden = !snap.waiting_for;
  $("notice").replaceChildren(snap.waiting_for
    ? explained("notice-text", `waiting for: ${snap.waiting_for}`, snap.waiting_for_raw, "notice") : "");
  fillModes(snap);
  renderSummary(snap);
  renderLayers(snap);
  renderMembers(snap);
  renderPlots(snap);
  renderRecoveries(snap);
}

function renderSummary(snap) {
  const cache = snap.prefix_cache;
  const hit = !cache.enabled ? "off" : cache.hit_rate === null ? "–" : `${(cache.hit_rate * 100).toFixed(0)}%`;
  const stat = (id, value, label) => el("div", { class: "stat" }, el("b", { id, text: value }), el("span", { text: label }));
  $("summary").replaceChildren(
    stat("running", snap.running, `running (of ${snap.max_running})`),
    stat("queued", snap.queued, "queued"),
    stat("stages", snap.layers.length, `stages · plan ${snap.plan_epoch}`),
    stat("cache-hit", hit, `prefix-cache hits (${cache.hits}/${cache.lookups})`),
    stat("default-mode", snap.default_mode || "–", "default mode"),
  );
}

function renderLayers(snap) {
  const bar = $("layer-bar");
  const segs = [];
  let next = 0;
  const names = Object.fromEntries(snap.members.map((m) => [m.id, m.name]));
  for (const s of snap.layers) {
    if (s.start > next) segs.push(gap(next, s.start - 1, snap.num_layers));
    const n = s.end - s.start + 1;
    segs.push(el("div", {
      class: "layer-seg", "data-member": s.member, "data-start": s.start, "data-end": s.end,
      style: `flex: ${n} 1 0; background: ${colorOf(s.member)}`,
      title: `${names[s.member]}: layers ${s.start}–${s.end}`,
    }, `${names[s.member]} · ${s.start}–${s.end}`));
    next = s.end + 1;
  }
  if (snap.num_layers && next < snap.num_layers) segs.push(gap(next, snap.num_layers - 1, snap.num_layers));
  bar.replaceChildren(...segs);
  bar.setAttribute("aria-label", snap.layers.map((s) => `${names[s.member]} layers ${s.start} to ${s.end}`).join("; "));
  $("layers-caption").textContent = `${snap.num_layers} layers over ${snap.layers.length} stages`;
}
function gap(a, b) {
  return el("div", { class: "layer-seg layer-gap", style: `flex: ${b - a + 1} 1 0`, title: `layers ${a}–${b}: no stage` }, `${a}–${b} unheld`);
}

function stateText(m) {
  if (m.state === "fetching" && m.fetch) {
    const eta = m.fetch.eta_s >= 0 ? `, ETA ${m.fetch.eta_s.toFixed(0)} s` : "";
    return `fetching ${m.fetch.percent.toFixed(0)}%${eta}`;
  }
  if (m.state === "lost") return `lost ${ago(m.since)}`;
  return m.state;
}
function stateBadge(m) {
  const badge = el("span", { class: `badge ${m.state}` });
  badge.append(m.state === "lost" ? age("lost", m.since) : stateText(m));
  return badge;
}

function renderMembers(snap) {
  const cards = snap.members.map((m) => {
    const color = colorOf(m.id);
    const used = m.memory_total && m.memory_used !== null ? (100 * m.memory_used) / m.memory_total : 0;
    const layers = m.layers ? `${m.layers[0]}–${m.layers[1]}` : "–";
    const stage = m.stage !== undefined ? `${m.stage + 1} of ${snap.layers.length}` : "–";
    const last = (xs) => (xs.length ? xs[xs.length - 1].toFixed(2) : "–");
    return el("article", {
      class: `panel member ${m.state}`, style: `--c: ${color}`, "data-member": m.id,
      "data-state": m.state, "aria-label": `${m.name}: ${stateText(m)}`,
    },
    el("header", {}, el("h3", { text: m.name }), stateBadge(m)),
    el("dl", {},
      el("dt", { text: "role" }), el("dd", { text: m.role }),
      el("dt", { text: "address" }), el("dd", { text: m.address || "–" }),
      el("dt", { text: "device" }), el("dd", { text: m.device || "–" }),
      el("dt", { text: "stage" }), el("dd", { text: stage }),
      el("dt", { text: "layers" }), el("dd", { text: layers }),
      el("dt", { text: "memory" }), el("dd", {},
        !m.memory_total ? "–" : m.memory_used === null ? `? / ${gib(m.memory_total)} GiB`
          : `${gib(m.memory_used)} / ${gib(m.memory_total)} GiB`,
        el("div", { class: "mem", role: "meter", "aria-valuemin": 0, "aria-valuemax": 100,
          "aria-valuenow": used.toFixed(0), "aria-label": "memory used" },
        el("div", { style: `width: ${used.toFixed(1)}%` }))),
    ),
    m.role === "worker" && m.state !== "refused" ? el("div", { class: "timing" },
      el("span", { text: `last step: compute ${last(m.compute_ms)} ms · hop ${last(m.hop_ms)} ms` })) : null,
    m.role === "coordinator" ? el("div", { class: "timing" },
      el("span", { text: "in-process stage: embedding, its layers, head and sampling" })) : null,
    m.role === "worker" && m.compute_ms.length ? timingPlot(m) : null,
    m.detail ? explained("detail", m.detail, m.detail_raw, `member:${m.id}`) : null);
  });
  $("members").replaceChildren(...cards);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function timingPlot(m) {
  // the last steps: hop (light) over compute (the member's colour), one bar per step
  const box = svg("svg", { viewBox: "0 0 120 28", preserveAspectRatio: "none", role: "img",
    "aria-label": "compute and hop ms of the last steps" });
  const n = m.hop_ms.length;
  const top = Math.max(...m.hop_ms, ...m.compute_ms, 0.001);
  const w = 120 / Math.max(n, 1);
  m.hop_ms.forEach((hop, i) => {
    const h = (26 * hop) / top;
    box.append(svg("rect", { x: i * w, y: 28 - h, width: Math.max(w - 0.5, 0.5), height: h, fill: "#475569" }));
    const c = (26 * (m.compute_ms[i] || 0)) / top;
    box.append(svg("rect", { x: i * w, y: 28 - c, width: Math.max(w - 0.5, 0.5), height: c, fill: colorOf(m.id) }));
  });
  return el("div", { class: "timing" }, box);
}

// the plots' time axis: the last 5 minutes, or since the first sample (at least a minute)
// when that is shorter; the figures under them read the same window
function plotWindow(snap) {
  const times = snap.history.t;
  const span = Math.min(300, Math.max(60, times.length ? snap.time - times[0] : 60));
  return { t0: snap.time - span, span };
}

function plot(target, times, series, snap) {
  const box = $(target);
  box.replaceChildren();
  const { t0, span } = plotWindow(snap);
  const x = (t) => ((t - t0) / span) * 300;
  let top = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
  top = top > 0 ? top * 1.15 : 1;
  const y = (v) => 78 - (76 * v) / top;
  for (const r of snap.recoveries) {  // a band for the time it took, a line at its end
    if (r.at < t0) continue;
    const start = Math.max(r.at - r.seconds, t0);
    box.append(svg("rect", { x: x(start), y: 0, width: Math.max(x(r.at) - x(start), 1.5), height: 80,
      fill: r.lost ? "#f8717155" : "#fbbf2444" }));
    box.append(svg("line", { x1: x(r.at), x2: x(r.at), y1: 0, y2: 80,
      stroke: r.lost ? "#f87171" : "#fbbf24", "stroke-width": 1.2, "vector-effect": "non-scaling-stroke" }));
  }
  for (const s of series) {
    const pts = [];
    s.values.forEach((v, i) => { if (v !== null && times[i] >= t0) pts.push([x(times[i]).toFixed(1), y(v).toFixed(1), v]); });
    if (pts.length) {
      box.append(svg("polyline", { points: pts.map(([px, py]) => `${px},${py}`).join(" "), fill: "none",
        stroke: s.color, "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
    }
    // a sparse series (TTFT: a value only in seconds when a first token came) gets a dot
    // per value: one request is one point, which a line alone does not draw
    if (s.dots) {
      for (const [px, py, v] of pts) {
        const dot = svg("line", { class: "point", x1: px, x2: px, y1: py, y2: py, stroke: s.color,
          "stroke-width": 6, "stroke-linecap": "round", "vector-effect": "non-scaling-stroke", "data-value": v });
        box.append(dot);
      }
    }
  }
  const title = svg("title", {});
  title.textContent = `max ${top.toFixed(1)}`;
  box.append(title);
}

function renderPlots(snap) {
  const h = snap.history;
  const { t0 } = plotWindow(snap);
  const latest = (xs) => { for (let i = xs.length - 1; i >= 0 && h.t[i] >= t0; i--) if (xs[i] !== null) return xs[i]; return null; };
  plot("plot-tok", h.t, [{ values: h.tok_s, color: "#60a5fa" }], snap);
  plot("plot-ttft", h.t, [{ values: h.ttft_ms, color: "#f59e0b", dots: true }], snap);
  plot("plot-load", h.t, [{ values: h.running, color: "#34d399" }, { values: h.queued, color: "#f472b6" }], snap);
  const peak = h.tok_s.length ? Math.max(...h.tok_s) : null;
  $("val-tok").textContent = `now ${fmt(latest(h.tok_s))} · peak ${fmt(peak)}`;
  const ttft = latest(h.ttft_ms);
  $("val-ttft").textContent = ttft === null ? "no first token in this window" : `last ${fmt(ttft, 0)} ms`;
  $("val-load").textContent = `running ${snap.running} (green) · queued ${snap.queued} (pink)`;
}

function renderRecoveries(snap) {
  const items = snap.recoveries.slice().reverse().map((r) => el("li", { class: "recovery", "data-lost": r.lost },
    el("span", { class: "when", text: clock(r.at) }),
    el("b", { text: r.lost ? "recovered" : "re-planned" }), ` in ${r.seconds.toFixed(2)} s — `,
    explained("reason", r.reason, r.reason_raw, `recovery:${r.at}`)));
  $("recoveries").replaceChildren(...(items.length ? items : [el("li", { class: "muted", text: "none since the coordinator started" })]));
}

// ---- the chat view ----------------------------------------------------------------------
function fillModes(snap) {
  const select = $("mode");
  const want = snap.modes.join(",");
  if (select.dataset.modes === want) return;
  select.dataset.modes = want;
  const current = select.value || "auto";
  select.replaceChildren(...snap.modes.map((m) => el("option", { value: m,
    text: m === "auto" ? `model default (${snap.default_mode})` : m })));
  select.value = snap.modes.includes(current) ? current : "auto";
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function addMessage(role, text) {
  const body = el("span", { class: "answer" }, text);
  const node = el("div", { class: `msg ${role}` }, el("span", { class: "who", text: role === "user" ? "you" : "model" }), body);
  $("log").append(node);
  node.scrollIntoView({ block: "end" });
  return { node, body };
}

async function send(text) {
  const snap = state.snapshot;
  if (!snap || state.running) return;
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  const { node, body } = addMessage("assistant", "");
  node.setAttribute("aria-busy", "true");
  // what the answer is doing while it streams: "prefilling… 1.2 s" until its first token
  // (the prompt's forward, and any wait in the queue), then its counts so far
  const live = el("span", { class: "live prefilling", role: "status",
    title: "waiting for the first token: the queue, then the prompt's forwards" });
  node.append(live);
  const request = {
    model: snap.model, messages: state.chat, stream: true,
    stream_options: { include_usage: true }, stream_commits: true,
    max_tokens: numberField("max-tokens"),
  };
  const mode = $("mode").value;
  if (mode && mode !== "auto") request.mode = mode;
  for (const [field, id] of [["window", "window"], ["threshold", "threshold"]]) {
    const v = numberField(id);
    if (v !== undefined) request[field] = v;
  }
  const control = new AbortController();
  state.running = control;
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let firstAt = null, answer = "", groups = 0, forwards = 0, tokens = 0, usage = null, finish = null, error = null;
  const prefilling = () => {
    live.replaceChildren("prefilling… ", el("b", { class: "elapsed",
      text: `${((performance.now() - started) / 1000).toFixed(1)} s` }));
  };
  prefilling();
  const ticker = setInterval(prefilling, 100);
  // tokens per forward so far, from the forwards each commit chunk says it took
  const decoding = () => {
    live.className = "live decoding";
    live.replaceChildren(el("b", { class: "live-tokens", text: tokens }), ` token${tokens === 1 ? "" : "s"} in `,
      el("b", { class: "live-forwards", text: forwards }), ` forward${forwards === 1 ? "" : "s"} · `,
      el("b", { class: "live-tpf", text: forwards ? (tokens / forwards).toFixed(2) : "–" }),
      " tokens/forward so far");
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(request), signal: control.signal,
    });
    if (response.status === 401) { askForKey("That key was refused."); return; }
    if (!response.ok) {
      const b = await response.json().catch(() => ({}));
      throw new Error(b.error?.message || `HTTP ${response.status}`);
    }
    for await (const data of sse(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const piece = choice.delta && choice.delta.content;
      if (!piece) continue;
      if (firstAt === null) {
        firstAt = performance.now();
        clearInterval(ticker);
      }
      const n = chunk.wedlm ? chunk.wedlm.forwards : 1;
      const count = chunk.wedlm ? chunk.wedlm.tokens : null;
      forwards += n;
      tokens += count ?? 1;
      const span = el("span", {
        class: `fw ${groups % 2 ? "b" : "a"}${count > 1 && n === 1 ? " multi" : ""}`,
        "data-forwards": n, "data-tokens": count,
        title: n === 1 ? `one forward: ${count} token${count === 1 ? "" : "s"}` : `${n} forwards: ${count} tokens`,
      }, piece);
      body.append(span);
      groups += 1;
      answer += piece;
      decoding();
      node.scrollIntoView({ block: "end" });
    }
  } catch (err) {
    if (!control.signal.aborted) error = err.message;
  } finally {
    clearInterval(ticker);
    live.remove();
    state.running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    node.removeAttribute("aria-busy");
  }
  const seconds = (performance.now() - started) / 1000;
  const stopped = control.signal.aborted;
  state.chat.push({ role: "assistant", content: answer });
  const count = usage ? usage.completion_tokens : body.querySelectorAll(".fw").length;
  const fw = usage && usage.forwards ? usage.forwards : forwards;
  const stats = el("span", { class: "stats" });
  if (error) stats.append(el("span", { class: "error", text: `error: ${error}` }));
  else if (stopped) stats.append("stopped (the request was cancelled)");
  else {
    stats.append(el("b", { text: count }), " tokens in ", el("b", { text: fw }), " forwards · ",
      el("b", { class: "tpf", text: fw ? (count / fw).toFixed(2) : "–" }), " tokens/forward · ",
      el("b", { class: "tps", text: (count / seconds).toFixed(1) }), " tok/s",
      ` · ${usage?.mode || mode} · ${finish || "?"}` +
      (firstAt ? ` · first token ${((firstAt - started)).toFixed(0)} ms` : ""));
  }
  node.append(stats);
  node.dataset.done = stopped ? "stopped" : error ? "error" : "done";
}

$("send-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("send-form").requestSubmit();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.running) state.running.abort();
});
$("stop").addEventListener("click", () => state.running && state.running.abort());
$("clear").addEventListener("click", () => { state.chat = []; $("log").replaceChildren(); });

show(location.hash === "#chat" ? "chat" : "cluster");
connect();
