// Canter dashboard: a hash-routed page over the JSON API under api/ (all URLs relative, so the
// dashboard works under a path prefix). No framework, no build step.
"use strict";

const STATES = ["WAITING", "PENDING", "CLAIMED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "EXPIRED", "SKIPPED"];
const FINISHED = new Set(["COMPLETED", "FAILED", "CANCELLED", "EXPIRED", "SKIPPED"]);
const FILTER_KEYS = ["state", "queue", "name", "from", "to"];
const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];
const view = $("#view");
const noticeEl = $("[data-testid=notice]");

// Shared state: the latest overview, the offset of the database clock, read-only, the route.
const S = { overview: null, skew: 0, ro: false, seq: 0, ctx: null, lastEvent: 0, started: false };

/* ---------- formatting ---------- */

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
const num = (n) => (n == null ? "—" : Number(n).toLocaleString());
const pad = (n) => String(n).padStart(2, "0");
const now = () => Date.now() + S.skew; // database clock
const cap = (s) => s.charAt(0).toUpperCase() + s.slice(1);
const json = (v) => esc(JSON.stringify(v === undefined ? null : v, null, 2));

function fmtTime(ms) {
  if (ms == null) return "—";
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}
// Value for <input type=datetime-local> from ms (local time).
const toLocalInput = (ms) => (ms === "" || ms == null || isNaN(+ms) ? "" : fmtTime(+ms).replace(" ", "T"));
function fromLocalInput(v) {
  if (!v) return null;
  const ms = new Date(v).getTime();
  if (isNaN(ms)) throw new Error(`not a date: ${v}`);
  return ms;
}

// A duration as 45s, 3m12s, 2h5m, 3d4h.
function dur(ms) {
  let s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  s %= 60;
  return d ? `${d}d${h}h` : h ? `${h}h${m}m` : `${m}m${s}s`;
}
function rel(ms) {
  if (ms == null) return "—";
  const d = ms - now();
  return Math.abs(d) < 1000 ? "now" : d < 0 ? `${dur(-d)} ago` : `in ${dur(d)}`;
}
// Relative time with the absolute one as tooltip, or both spelled out.
const ago = (ms) => (ms == null ? "—" : `<time title="${esc(fmtTime(ms))}">${esc(rel(ms))}</time>`);
const when = (ms) => (ms == null ? "—" : `${esc(fmtTime(ms))} <span class="muted">(${esc(rel(ms))})</span>`);

function badge(text, cls = text, testid = "state-badge") {
  return `<span class="badge st-${esc(cls)}" data-testid="${testid}">${esc(text)}</span>`;
}
// An action button: hidden by CSS and disabled when the dashboard is read-only.
function btn(testid, label, cls = "", attrs = "") {
  return `<button type="button" class="action ${cls}" data-testid="${testid}" ${attrs}${S.ro ? " disabled" : ""}>${esc(label)}</button>`;
}

/* ---------- API, notices, dialog ---------- */

async function api(path, opts) {
  let res;
  try {
    res = await fetch(path, opts);
  } catch (e) {
    throw new Error(`network error (${path}): ${e.message}`);
  }
  const text = await res.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    if (res.ok) throw new Error(`bad JSON from ${path}`);
  }
  if (!res.ok) throw new Error(`${res.status}: ${(body && body.error) || text.trim() || res.statusText}`);
  return body;
}
const post = (path, body) =>
  api(path, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body ?? {}) });

// The notice area shows the latest message: kind "ok", "warn" or "err".
function notice(msg, kind = "ok") {
  noticeEl.innerHTML = `<div class="notice ${kind}" data-kind="${kind}"><span>${esc(msg)}</span>` +
    `<button type="button" class="x" aria-label="Dismiss" data-testid="notice-close">×</button></div>`;
  $(".x", noticeEl).onclick = () => (noticeEl.innerHTML = "");
}

// Modal confirmation: resolves to the form (or check(form)'s value) on confirm, null on cancel.
// check may throw to show a message and keep the dialog open.
const dlg = $("#dialog");
// Using an input tagged data-pick="x" selects the radio button of value x.
for (const ev of ["focusin", "input"]) {
  $("#dialog-body").addEventListener(ev, (e) => {
    const r = e.target.dataset.pick && $(`input[type=radio][value="${e.target.dataset.pick}"]`, dlg);
    if (r) r.checked = true;
  });
}
function ask(title, bodyHtml, { ok = "Confirm", danger = false, check } = {}) {
  const form = $("#dialog-form"), err = $("#dialog-error"), okb = $("#dialog-ok");
  $("#dialog-title").textContent = title;
  $("#dialog-body").innerHTML = bodyHtml;
  err.hidden = true;
  okb.textContent = ok;
  okb.classList.toggle("danger", danger);
  return new Promise((resolve) => {
    const done = (v) => {
      form.onsubmit = dlg.onclose = $("#dialog-cancel").onclick = null;
      if (dlg.open) dlg.close();
      resolve(v);
    };
    form.onsubmit = (e) => {
      e.preventDefault();
      try {
        done(check ? check(form) ?? true : form);
      } catch (x) {
        err.textContent = x.message;
        err.hidden = false;
      }
    };
    $("#dialog-cancel").onclick = () => done(null);
    dlg.onclose = () => done(null); // Escape
    dlg.showModal();
    ($("input, textarea, select", $("#dialog-body")) || okb).focus();
  });
}

/* ---------- live overview: SSE, polling fallback ---------- */

let es = null, esErrors = 0, pollTimer = null;

function setLive(state, text, title = text) {
  const el = $("[data-testid=live]");
  el.dataset.state = state;
  el.title = title;
  $("span", el).textContent = text;
}

function onOverview(o) {
  S.overview = o;
  S.skew = (o.at || Date.now()) - Date.now();
  S.lastEvent = Date.now();
  $("[data-testid=refreshed]").textContent = `updated ${fmtTime(o.at).slice(11)}` + (o.took_ms != null ? ` · ${o.took_ms} ms` : "");
  if (!!o.read_only !== S.ro) {
    S.ro = !!o.read_only;
    document.body.classList.toggle("ro", S.ro);
    $("[data-testid=readonly-badge]").hidden = !S.ro;
    if (S.started) return route(true); // re-render with the buttons hidden or shown
  }
  if (S.ctx && S.ctx.live) S.ctx.live(o);
}

async function refreshOverview() {
  try {
    onOverview(await api("api/overview"));
    return true;
  } catch (e) {
    if (!S.overview) notice(`Overview unavailable: ${e.message}`, "err");
    return false;
  }
}

function startSSE() {
  if (!window.EventSource) return startPolling();
  const src = (es = new EventSource("api/events"));
  src.addEventListener("overview", (e) => {
    esErrors = 0;
    stopPolling();
    try {
      onOverview(JSON.parse(e.data));
      setLive("live", "live", "receiving live updates");
    } catch (x) {
      console.error("bad overview event", x);
    }
  });
  src.onerror = () => {
    // EventSource reconnects by itself; after repeated errors poll instead, and try again later.
    if (++esErrors >= 3 || src.readyState === EventSource.CLOSED) {
      src.close();
      es = null;
      esErrors = 0;
      startPolling();
      setTimeout(startSSE, 60000);
    } else if (!pollTimer) setLive("connecting", "reconnecting");
  };
}

async function pollOnce() {
  if (await refreshOverview()) {
    if (pollTimer) setLive("polling", "polling", "live updates unavailable: polling every 5 s");
  } else setLive("offline", "offline", "the dashboard server does not answer");
}
function startPolling() {
  if (pollTimer) return;
  pollTimer = setInterval(pollOnce, 5000);
  pollOnce();
}
function stopPolling() {
  clearInterval(pollTimer);
  pollTimer = null;
}
// Mark the feed stale when no update came for a while.
setInterval(() => {
  const every = (S.overview && S.overview.refresh_ms) || 2000;
  const el = $("[data-testid=live]");
  if (el.dataset.state === "live" && Date.now() - S.lastEvent > Math.max(10000, 3 * every)) setLive("stale", "stale", "no update for a while");
}, 5000);

/* ---------- router ---------- */

const ROUTES = [
  [/^\/?$/, "overview", overviewPage],
  [/^\/tasks$/, "tasks", tasksPage],
  [/^\/tasks\/(\d+)$/, "tasks", taskPage],
  [/^\/queues$/, "queues", queuesPage],
  [/^\/schedules$/, "schedules", schedulesPage],
  [/^\/workflows$/, "workflows", workflowsPage],
  [/^\/workflows\/(\d+)$/, "workflows", workflowPage],
];

function parseHash() {
  const h = location.hash.replace(/^#/, "") || "/";
  const i = h.indexOf("?");
  return { path: i < 0 ? h : h.slice(0, i), params: new URLSearchParams(i < 0 ? "" : h.slice(i + 1)) };
}

let keepNotice = false;
// Navigate (or re-render when already there); keep: leave the notice shown.
function go(hash, keep = false) {
  keepNotice = keep;
  if (location.hash === hash) route();
  else location.hash = hash;
}

async function route(keep = false) {
  if (!keep && !keepNotice) noticeEl.innerHTML = "";
  keepNotice = false;
  const { path, params } = parseHash();
  const ctx = { seq: ++S.seq, live: null };
  ctx.stale = () => ctx.seq !== S.seq;
  S.ctx = ctx;
  const hit = ROUTES.map(([re, name, page]) => [path.match(re), name, page]).find(([m]) => m);
  for (const a of $$("nav a")) a.classList.toggle("active", !!hit && a.dataset.route === hit[1]);
  if (!hit) {
    view.innerHTML = `<h1>Not found</h1><p>No page at <code>${esc(path)}</code>. <a href="#/">Overview</a></p>`;
    return;
  }
  document.title = `Canter · ${cap(hit[1])}`;
  try {
    await hit[2](hit[0], params, ctx);
  } catch (e) {
    if (ctx.stale()) return;
    view.innerHTML = `<p class="muted" data-testid="load-error">Could not load this page.</p>`;
    notice(e.message, "err");
  }
}
window.addEventListener("hashchange", () => route());

/* ---------- overview ---------- */

const COUNT_COLS = ["due", "scheduled", "claimed", "running", "completed", "failed", "cancelled", "expired", "skipped"];

function overviewPage(m, p, ctx) {
  ctx.live = renderOverview;
  if (S.overview) renderOverview(S.overview);
  else view.innerHTML = `<h1>Overview</h1><p class="muted">Waiting for data from the server…</p>`;
}

function renderOverview(o) {
  const qs = o.queues || [];
  const total = (k) => qs.reduce((a, q) => a + (q[k] || 0), 0);
  const paused = qs.filter((q) => q.paused);
  const workers = [...(o.workers || [])].sort((a, b) => a.stopped - b.stopped || String(a.id).localeCompare(b.id));
  view.innerHTML = `<h1>Overview</h1>
<section class="card">
  <h2>Queues <span class="muted small">finished counts since ${esc(fmtTime(o.since))} (${esc(rel(o.since))})</span></h2>
  <div class="scroll"><table data-testid="counts-table">
    <thead><tr><th>Queue</th>${COUNT_COLS.map((c) => `<th class="num">${c}</th>`).join("")}</tr></thead>
    <tbody>${qs.map((q) => `<tr data-testid="queue-row" data-queue="${esc(q.queue)}">
      <td><a href="#/tasks?queue=${esc(encodeURIComponent(q.queue))}">${esc(q.queue)}</a>${q.paused ? " " + badge("paused", "paused", "queue-paused") : ""}</td>
      ${COUNT_COLS.map((c) => `<td class="num${c === "failed" && q[c] ? " bad" : ""}">${num(q[c])}</td>`).join("")}</tr>`).join("") ||
      `<tr><td colspan="${COUNT_COLS.length + 1}" class="muted">No queues yet.</td></tr>`}</tbody>
    ${qs.length > 1 ? `<tfoot><tr><th>Total</th>${COUNT_COLS.map((c) => `<th class="num">${num(total(c))}</th>`).join("")}</tr></tfoot>` : ""}
  </table></div>
</section>
<section class="card"><h2>Throughput <span class="muted small">tasks finished per second</span></h2>${chart(o.throughput || [])}</section>
<div class="grid2 wide-left">
<section class="card"><h2>Workers <span class="muted small">${workers.filter((w) => !w.stopped).length} live</span></h2>
  <div class="scroll"><table data-testid="workers-table">
    <thead><tr><th>Worker</th><th>Queues</th><th class="num">Concurrency</th><th class="num">Claimed</th><th class="num">Running</th><th>Last seen</th></tr></thead>
    <tbody>${workers.map((w) => `<tr data-testid="worker-row" data-id="${esc(w.id)}" class="${w.stopped ? "stopped" : ""}">
      <td class="mono">${esc(w.id)}${w.stopped ? " " + badge("stopped", "CANCELLED") : ""}</td>
      <td class="wrap">${(w.queues || []).map(esc).join(", ")}</td><td class="num">${num(w.concurrency)}</td>
      <td class="num">${num(w.claimed)}</td><td class="num">${num(w.running)}</td><td>${ago(w.last_seen)}</td></tr>`).join("") ||
      `<tr><td colspan="6" class="muted">No workers.</td></tr>`}</tbody>
  </table></div>
</section>
<section class="card"><h2>Paused queues</h2>
  <ul class="plain" data-testid="paused-queues">${paused.map((q) => `<li><a href="#/queues">${esc(q.queue)}</a> <span class="muted">paused ${ago(q.paused_at)}</span></li>`).join("") ||
    `<li class="muted">None.</li>`}</ul>
  <p class="muted small">Snapshot every ${num(o.refresh_ms)} ms, last took ${num(o.took_ms)} ms.</p>
</section>
</div>`;
}

// The throughput chart: completed/s and failed/s over time, as inline SVG.
function chart(points) {
  const W = 760, H = 220, L = 52, R = 14, T = 14, B = 30;
  let svg = `<svg data-testid="throughput-chart" class="chart" viewBox="0 0 ${W} ${H}" role="img" aria-label="Throughput chart">`;
  if (points.length < 2) {
    return svg + `<text class="axis" x="${W / 2}" y="${H / 2}" text-anchor="middle">Collecting data…</text></svg>`;
  }
  const t0 = points[0].at, t1 = points[points.length - 1].at, span = Math.max(1, t1 - t0);
  const top = niceMax(Math.max(...points.map((p) => Math.max(p.completed || 0, p.failed || 0))));
  const x = (t) => L + ((t - t0) / span) * (W - L - R);
  const y = (v) => T + (1 - v / top) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = (top * i) / 4;
    svg += `<line class="grid" x1="${L}" x2="${W - R}" y1="${y(v)}" y2="${y(v)}"/>` +
      `<text class="axis" x="${L - 6}" y="${y(v) + 4}" text-anchor="end">${esc(fmtRate(v))}</text>`;
  }
  for (const [t, anchor] of [[t0, "start"], [(t0 + t1) / 2, "middle"], [t1, "end"]]) {
    svg += `<text class="axis" x="${x(t)}" y="${H - 10}" text-anchor="${anchor}">${esc(fmtTime(t).slice(11))}</text>`;
  }
  svg += `<text class="axis" x="12" y="${T + (H - T - B) / 2}" text-anchor="middle" transform="rotate(-90 12 ${T + (H - T - B) / 2})">tasks/s</text>`;
  const line = (k) => `<polyline class="line ${k}" data-testid="line-${k}" points="${points.map((p) => `${x(p.at).toFixed(1)},${y(p[k] || 0).toFixed(1)}`).join(" ")}"/>`;
  const last = points[points.length - 1];
  svg += line("completed") + line("failed");
  svg += `<g class="legend" transform="translate(${W - R - 250},${T + 4})">
    <rect class="completed" width="10" height="10"/><text x="14" y="9">completed/s ${esc(fmtRate(last.completed || 0))}</text>
    <rect class="failed" x="130" width="10" height="10"/><text x="144" y="9">failed/s ${esc(fmtRate(last.failed || 0))}</text></g>`;
  return svg + `</svg>`;
}
function niceMax(v) {
  if (!(v > 0)) return 1;
  const e = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * e).find((c) => c >= v);
}
const fmtRate = (v) => (v >= 100 ? Math.round(v).toLocaleString() : String(+v.toFixed(v >= 10 ? 1 : 2)));

/* ---------- tasks ---------- */

function describeFilter(f) {
  const parts = FILTER_KEYS.filter((k) => f[k] !== "" && f[k] != null)
    .map((k) => `${k} ${k === "from" ? "≥" : k === "to" ? "<" : "="} ${k === "from" || k === "to" ? fmtTime(+f[k]) : f[k]}`);
  return parts.join(", ");
}

async function tasksPage(m, p, ctx) {
  const f = Object.fromEntries(FILTER_KEYS.map((k) => [k, p.get(k) || ""]));
  const before = p.get("before") || "";
  const filterText = describeFilter(f);
  view.innerHTML = `<h1>Tasks</h1>
<form class="card filters" data-testid="task-filters">
  <label>State <select name="state" data-testid="filter-state"><option value="">any</option>${STATES.map((s) => `<option${s === f.state ? " selected" : ""}>${s}</option>`).join("")}</select></label>
  <label>Queue <input name="queue" data-testid="filter-queue" value="${esc(f.queue)}" placeholder="any"></label>
  <label>Task name <input name="name" data-testid="filter-name" value="${esc(f.name)}" placeholder="any"></label>
  <label>Enqueued from <input type="datetime-local" step="1" name="from" data-testid="filter-from" value="${esc(toLocalInput(f.from))}"></label>
  <label>to <input type="datetime-local" step="1" name="to" data-testid="filter-to" value="${esc(toLocalInput(f.to))}"></label>
  <span class="buttons"><button class="primary" data-testid="filter-apply">Apply</button>
  <button type="button" data-testid="filter-clear">Clear</button></span>
</form>
<div class="bulk action" data-testid="bulk-bar">
  <span class="muted" data-testid="selection-count">0 selected</span>
  ${btn("bulk-cancel", "Cancel")}${btn("bulk-retry", "Retry")}${btn("bulk-delete", "Delete", "danger")}
  <span class="sep"></span>
  <span class="muted small">All matching the filter:</span>
  ${btn("bulk-cancel-all", "Cancel all…")}${btn("bulk-retry-all", "Retry all…")}${btn("bulk-delete-all", "Delete all…", "danger")}
</div>
<div class="card flush" id="task-list" data-testid="task-list"><p class="muted pad">Loading…</p></div>
<div class="pager">
  <button type="button" data-testid="first-page"${before ? "" : " disabled"}>First page</button>
  <button type="button" data-testid="next-page" disabled>Next page</button>
  <span class="muted small" data-testid="page-info"></span>
</div>`;

  const form = $("[data-testid=task-filters]");
  form.onsubmit = (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    try {
      for (const k of FILTER_KEYS) {
        const v = k === "from" || k === "to" ? fromLocalInput(form.elements[k].value) : form.elements[k].value.trim();
        if (v !== null && v !== "") q.set(k, v);
      }
    } catch (x) {
      return notice(x.message, "err");
    }
    go(`#/tasks${q.toString() ? "?" + q : ""}`);
  };
  $("[data-testid=filter-clear]").onclick = () => go("#/tasks");

  const sel = new Set();
  const syncSel = () => {
    $("[data-testid=selection-count]").textContent = `${sel.size} selected`;
    for (const a of ["cancel", "retry", "delete"]) $(`[data-testid=bulk-${a}]`).disabled = S.ro || sel.size === 0;
    const boxes = $$("[data-testid=task-check]"), all = $("[data-testid=select-all]");
    if (all) {
      all.checked = boxes.length > 0 && boxes.every((b) => b.checked);
      all.indeterminate = sel.size > 0 && !all.checked;
    }
  };

  const filterQuery = () => {
    const q = new URLSearchParams();
    for (const k of FILTER_KEYS) if (f[k]) q.set(k, f[k]);
    return q;
  };

  const load = async () => {
    const q = filterQuery();
    if (before) q.set("before", before);
    q.set("limit", "50");
    const data = await api(`api/tasks?${q}`);
    if (ctx.stale()) return;
    sel.clear();
    const tasks = data.tasks || [];
    $("#task-list").innerHTML = `<div class="scroll"><table data-testid="tasks-table" class="rows">
  <thead><tr><th class="check"><input type="checkbox" class="action" data-testid="select-all" aria-label="Select all on this page"${S.ro ? " disabled" : ""}></th>
  <th class="num">ID</th><th>Name</th><th>Queue</th><th>State</th><th class="num">Priority</th><th class="num">Attempts</th><th>Enqueued</th><th>Run at</th><th>Finished</th></tr></thead>
  <tbody>${tasks.map((t) => `<tr data-testid="task-row" data-id="${esc(t.id)}" data-state="${esc(t.state)}">
    <td class="check"><input type="checkbox" class="action" data-testid="task-check" data-id="${esc(t.id)}" aria-label="Select task ${esc(t.id)}"${S.ro ? " disabled" : ""}></td>
    <td class="num"><a href="#/tasks/${esc(t.id)}">${esc(t.id)}</a></td>
    <td class="mono">${esc(t.name)}${t.error ? ` <span class="muted small" title="${esc(t.error.message)}">${esc(t.error.code)}</span>` : ""}</td>
    <td>${esc(t.queue)}</td><td>${badge(t.state)}</td><td class="num">${num(t.priority)}</td>
    <td class="num" title="retries: ${esc(t.retries)}">${num(t.attempts)}</td>
    <td>${ago(t.enqueued_at)}</td><td>${ago(t.run_at)}</td><td>${ago(t.finished_at)}</td></tr>`).join("") ||
    `<tr><td colspan="10" class="muted" data-testid="no-tasks">No tasks${filterText ? " match " + esc(filterText) : ""}.</td></tr>`}</tbody>
</table></div>`;
    const next = $("[data-testid=next-page]");
    next.disabled = data.next_before == null;
    next.onclick = () => {
      const q2 = filterQuery();
      q2.set("before", data.next_before);
      go(`#/tasks?${q2}`);
    };
    $("[data-testid=page-info]").textContent = `${tasks.length} task${tasks.length === 1 ? "" : "s"}` +
      (before ? ` with id below ${before}` : "") + (filterText ? ` · ${filterText}` : "");
    syncSel();
  };
  const loadOrShow = () => load().catch((e) => {
    $("#task-list").innerHTML = `<p class="muted pad" data-testid="load-error">Could not load the tasks.</p>`;
    notice(e.message, "err");
  });

  $("[data-testid=first-page]").onclick = () => go(`#/tasks${filterQuery().toString() ? "?" + filterQuery() : ""}`);
  $("#task-list").onclick = (e) => {
    if (e.target.closest("td.check, th.check, a")) return;
    const tr = e.target.closest("tr[data-id]");
    if (tr) go(`#/tasks/${tr.dataset.id}`);
  };
  $("#task-list").onchange = (e) => {
    const t = e.target;
    if (t.dataset.testid === "select-all") {
      for (const b of $$("[data-testid=task-check]")) b.checked = t.checked;
    }
    sel.clear();
    for (const b of $$("[data-testid=task-check]")) if (b.checked) sel.add(Number(b.dataset.id));
    syncSel();
  };

  const bulk = async (action, body, what) => {
    const ok = await ask(`${cap(action)} tasks`, `<p data-testid="confirm-text">${cap(action)} ${esc(what)}?</p>` +
      (action === "delete" ? `<p class="muted small">Only finished tasks are deleted, with their history.</p>` : ""),
      { ok: cap(action), danger: action !== "retry" });
    if (!ok) return;
    try {
      const r = await post("api/bulk", { action, ...body });
      const refused = r.refused || [], nref = r.refused_total ?? refused.length;
      notice(`${cap(action)}: done ${r.done}, refused ${nref}` +
        (refused.length ? ` — ${refused.slice(0, 3).map((x) => `#${x.id}: ${x.error}`).join("; ")}${nref > 3 ? "; …" : ""}` : ""), nref ? "warn" : "ok");
    } catch (e) {
      notice(`${cap(action)} failed: ${e.message}`, "err");
    }
    await loadOrShow();
  };
  for (const a of ["cancel", "retry", "delete"]) {
    $(`[data-testid=bulk-${a}]`).onclick = () => {
      const ids = [...sel];
      const list = ids.slice(0, 10).map((i) => "#" + i).join(", ") + (ids.length > 10 ? ", …" : "");
      bulk(a, { ids }, `${ids.length} selected task${ids.length === 1 ? "" : "s"} (${list})`);
    };
    $(`[data-testid=bulk-${a}-all]`).onclick = () => {
      const filter = {};
      for (const k of FILTER_KEYS) if (f[k]) filter[k] = k === "from" || k === "to" ? Number(f[k]) : f[k];
      bulk(a, { filter }, filterText ? `ALL tasks matching ${filterText} (every page, not only this one)` : "EVERY task in the database (no filter is set)");
    };
  }
  await loadOrShow();
}

/* ---------- task detail ---------- */

async function taskPage(m, p, ctx) {
  const id = Number(m[1]);
  view.innerHTML = `<p class="muted">Loading task #${id}…</p>`;
  const load = async () => {
    const d = await api(`api/tasks/${id}`);
    if (!ctx.stale()) renderTask(d, ctx, load);
  };
  await load();
}

function renderTask(d, ctx, reload) {
  const t = d.task, wf = d.workflow;
  const field = (k, v) => `<dt>${k}</dt><dd>${v}</dd>`;
  view.innerHTML = `<div class="crumbs"><a href="#/tasks">Tasks</a> / #${esc(t.id)}</div>
<h1>Task #${esc(t.id)} <span class="mono">${esc(t.name)}</span> ${badge(t.state, t.state, "task-state")}</h1>
<div class="actions" data-testid="task-actions">
  ${btn("act-cancel", "Cancel")}${btn("act-retry", "Retry")}${btn("act-reschedule", "Reschedule…")}
  ${btn("act-complete", "Complete…")}${btn("act-fail", "Fail…")}${btn("act-delete", "Delete", "danger")}
</div>
<div class="grid2">
<section class="card"><h2>Fields</h2><dl class="fields" data-testid="task-fields">
  ${field("ID", esc(t.id))}${field("Name", `<span class="mono">${esc(t.name)}</span>`)}
  ${field("Queue", `<a href="#/tasks?queue=${esc(encodeURIComponent(t.queue))}">${esc(t.queue)}</a>`)}
  ${field("State", badge(t.state))}${field("Priority", num(t.priority))}
  ${field("Attempts", num(t.attempts))}${field("Retries", num(t.retries))}
  ${field("Enqueued", when(t.enqueued_at))}${field("Run at", when(t.run_at))}
  ${field("Good until", when(t.good_until))}${field("Finished", when(t.finished_at))}
  ${field("Worker", t.worker ? `<span class="mono">${esc(t.worker)}</span>` : "—")}
  ${field("Key", t.key != null ? `<span class="mono">${esc(t.key)}</span>` : "—")}
  ${t.flags && t.flags.length ? field("Flags", t.flags.map((x) => `<span class="tag">${esc(x)}</span>`).join(" ")) : ""}
  ${wf ? field("Workflow", `<a data-testid="workflow-link" href="#/workflows/${esc(wf.id)}">workflow #${esc(wf.id)}, step ${esc(wf.step)}</a>`) : ""}
</dl></section>
<section class="card"><h2>History</h2>${timeline(t, d.attempts || [])}</section>
</div>
<section class="card"><h2>Arguments</h2>${t.args_error ? `<p class="warn-text">Arguments unreadable: ${esc(t.args_error)}</p>` : ""}
  <pre data-testid="task-args">${json(t.args)}</pre></section>
${t.result != null ? `<section class="card"><h2>Result</h2><pre data-testid="task-result">${json(t.result)}</pre></section>` : ""}
${t.error ? `<section class="card error-card" data-testid="task-error"><h2>Error</h2>
  <p><code class="code" data-testid="error-code">${esc(t.error.code)}</code> <span data-testid="error-message">${esc(t.error.message)}</span></p>
  ${"data" in t.error ? `<pre data-testid="error-data">${json(t.error.data)}</pre>` : ""}</section>` : ""}`;

  const label = `task #${t.id} (${t.name}, ${t.state})`;
  const run = async (action, extra = {}, after) => {
    try {
      await post("api/admin", { action, task: t.id, ...extra });
      notice(`Task #${t.id}: ${action} done`);
      if (after) return after();
    } catch (e) {
      notice(`Task #${t.id}: ${action} refused: ${e.message}`, "err");
    }
    await reload().catch((e) => notice(e.message, "err"));
  };
  const simple = (action, danger, extraText = "") => async () => {
    if (await ask(`${cap(action)} task`, `<p data-testid="confirm-text">${cap(action)} ${esc(label)}?</p>${extraText}`, { ok: cap(action), danger })) run(action);
  };
  $("[data-testid=act-cancel]").onclick = simple("cancel", true);
  $("[data-testid=act-retry]").onclick = simple("retry", false);
  $("[data-testid=act-delete]").onclick = async () => {
    if (!(await ask("Delete task", `<p data-testid="confirm-text">Delete ${esc(label)} with its history? This cannot be undone.</p>`, { ok: "Delete", danger: true }))) return;
    run("delete", {}, () => go("#/tasks", true));
  };
  $("[data-testid=act-reschedule]").onclick = async () => {
    const change = await ask(`Reschedule task #${t.id}`, `
<fieldset><legend>Run at</legend>
  <label><input type="radio" name="when" value="keep" checked> unchanged (${esc(fmtTime(t.run_at))})</label>
  <label><input type="radio" name="when" value="now"> now</label>
  <label><input type="radio" name="when" value="delay"> in <input type="number" name="delay" min="0" step="1" value="60" data-pick="delay" data-testid="resched-delay"> seconds</label>
  <label><input type="radio" name="when" value="at"> at <input type="datetime-local" step="1" name="at" data-pick="at" data-testid="resched-at"></label>
</fieldset>
<div class="row"><label>Priority <input type="number" step="1" name="priority" placeholder="${esc(t.priority)} (unchanged)" data-testid="resched-priority"></label>
<label>Retries <input type="number" step="1" min="0" name="retries" placeholder="${esc(t.retries)} (unchanged)" data-testid="resched-retries"></label></div>`,
    { ok: "Reschedule", check: (form) => rescheduleChange(form.elements) });
    if (change) run("reschedule", { change });
  };
  $("[data-testid=act-complete]").onclick = async () => {
    const result = await ask(`Complete task #${t.id}`, `<p>Mark ${esc(label)} completed with this result (JSON):</p>
<textarea name="result" rows="6" class="mono" data-testid="complete-result">null</textarea>`, {
      ok: "Complete",
      check: (form) => {
        try {
          return { value: JSON.parse(form.elements.result.value) };
        } catch (e) {
          throw new Error(`Not valid JSON: ${e.message}`);
        }
      },
    });
    if (result) run("complete", { result: result.value });
  };
  $("[data-testid=act-fail]").onclick = async () => {
    const message = await ask(`Fail task #${t.id}`, `<p>Mark ${esc(label)} failed.</p>
<label>Message <input name="message" required data-testid="fail-message" placeholder="why"></label>`, {
      ok: "Fail", danger: true,
      check: (form) => {
        const v = form.elements.message.value.trim();
        if (!v) throw new Error("Give a message.");
        return v;
      },
    });
    if (message) run("fail", { message });
  };
}

// The reschedule dialog's fields as the API's change object.
function rescheduleChange(el) {
  const change = {};
  const w = el.when.value;
  if (w === "now") change.run_at = "now";
  if (w === "delay") {
    const s = Number(el.delay.value);
    if (el.delay.value === "" || !(s >= 0)) throw new Error("Give a delay in seconds (0 or more).");
    change.run_at = { delay_ms: Math.round(s * 1000) };
  }
  if (w === "at") {
    const at = fromLocalInput(el.at.value);
    if (at == null) throw new Error("Give a date and time.");
    change.run_at = { at };
  }
  for (const k of ["priority", "retries"]) {
    if (el[k].value === "") continue;
    const v = Number(el[k].value);
    if (!Number.isInteger(v) || (k === "retries" && v < 0)) throw new Error(`${cap(k)} must be a${k === "retries" ? " non-negative" : "n"} integer.`);
    change[k] = v;
  }
  if (!Object.keys(change).length) throw new Error("Change at least one field.");
  return change;
}

// The attempts as a vertical timeline: enqueued, each finished run, then the current state.
function timeline(t, attempts) {
  const item = (cls, title, body, at) => `<li class="tl-${esc(cls)}" data-testid="timeline-item"><div class="tl-head"><b>${title}</b>` +
    `${at != null ? ` <span class="muted small">${esc(fmtTime(at))} · ${esc(rel(at))}</span>` : ""}</div>${body ? `<div class="tl-body">${body}</div>` : ""}</li>`;
  let html = item("PENDING", "Enqueued", `queue ${esc(t.queue)}`, t.enqueued_at);
  for (const a of attempts) {
    const out = a.outcome === "PENDING" ? badge("retried", "PENDING", "attempt-outcome") : badge(a.outcome, a.outcome, "attempt-outcome");
    html += item(a.outcome, `Attempt ${esc(a.attempt)} ${out}`,
      `worker <span class="mono">${esc(a.worker ?? "—")}</span>` +
      (a.error ? `<div class="tl-error"><code>${esc(a.error.code)}</code> ${esc(a.error.message)}</div>` : ""), a.finished_at);
  }
  const fin = FINISHED.has(t.state);
  const cur = fin ? "" : t.state === "PENDING" ? `runs ${esc(rel(t.run_at))}` :
    t.worker ? `on worker <span class="mono">${esc(t.worker)}</span>` : "";
  html += item(t.state, `${fin ? "Final state" : "Now"} ${badge(t.state)}`, cur, fin ? t.finished_at : null);
  return `<ol class="timeline" data-testid="timeline">${html}</ol>`;
}

/* ---------- queues ---------- */

function queuesPage(m, p, ctx) {
  ctx.live = renderQueues;
  if (S.overview) renderQueues(S.overview);
  else view.innerHTML = `<h1>Queues</h1><p class="muted">Waiting for data from the server…</p>`;
}

function renderQueues(o) {
  const qs = o.queues || [];
  const capText = (q) => [q.serial ? "serial" : "", q.max_concurrency != null ? `max ${q.max_concurrency}` : ""].filter(Boolean).join(", ") || "—";
  view.innerHTML = `<h1>Queues</h1>
<div class="card flush"><div class="scroll"><table data-testid="queues-table">
  <thead><tr><th>Queue</th><th class="num">Due</th><th class="num">Scheduled</th><th class="num">Claimed</th><th class="num">Running</th>
  <th>Oldest due</th><th>Cap</th><th>State</th><th class="action"></th></tr></thead>
  <tbody>${qs.map((q) => `<tr data-testid="queues-row" data-queue="${esc(q.queue)}" data-paused="${!!q.paused}">
    <td><a href="#/tasks?queue=${esc(encodeURIComponent(q.queue))}">${esc(q.queue)}</a></td>
    <td class="num">${num(q.due)}</td><td class="num">${num(q.scheduled)}</td><td class="num">${num(q.claimed)}</td><td class="num">${num(q.running)}</td>
    <td data-testid="oldest-due" title="${esc(fmtTime(q.oldest_due_at))}">${q.oldest_due_at == null ? "—" : esc(dur(now() - q.oldest_due_at))}</td>
    <td>${esc(capText(q))}</td>
    <td>${q.paused ? `${badge("paused", "paused", "paused-state")} <span class="muted small">${ago(q.paused_at)}</span>` : badge("active", "active", "paused-state")}</td>
    <td class="action">${q.paused ? btn("resume", "Resume", "", `data-queue="${esc(q.queue)}"`) : btn("pause", "Pause", "", `data-queue="${esc(q.queue)}"`)}</td></tr>`).join("") ||
    `<tr><td colspan="9" class="muted">No queues yet.</td></tr>`}</tbody>
</table></div></div>
<p class="muted small">Pausing a queue stops workers from claiming its tasks; tasks already claimed run on.</p>`;
  for (const b of $$("[data-testid=pause], [data-testid=resume]", view)) {
    b.onclick = async () => {
      const action = b.dataset.testid, queue = b.dataset.queue;
      if (!(await ask(`${cap(action)} queue`, `<p data-testid="confirm-text">${cap(action)} the queue <b>${esc(queue)}</b>?</p>`, { ok: cap(action), danger: action === "pause" }))) return;
      try {
        await post("api/admin", { action, queue });
        notice(`Queue ${queue}: ${action}d`);
      } catch (e) {
        notice(`Queue ${queue}: ${action} refused: ${e.message}`, "err");
      }
      refreshOverview();
    };
  }
}

/* ---------- schedules ---------- */

async function schedulesPage(m, p, ctx) {
  view.innerHTML = `<h1>Schedules</h1><p class="muted">Loading…</p>`;
  const d = await api("api/schedules");
  if (ctx.stale()) return;
  const ss = d.schedules || [];
  view.innerHTML = `<h1>Schedules</h1>
<div class="card flush"><div class="scroll"><table data-testid="schedules-table">
  <thead><tr><th>Name</th><th>Task</th><th>Queue</th><th>Cron</th><th>Last tick</th><th>Next tick</th></tr></thead>
  <tbody>${ss.map((s) => `<tr data-testid="schedule-row" data-name="${esc(s.name)}">
    <td class="mono">${esc(s.name)}</td><td class="mono">${esc(s.task ?? "—")}</td><td>${esc(s.queue ?? "—")}</td>
    <td><code>${esc(s.cron ?? "—")}</code></td><td>${when(s.last_tick)}</td><td>${when(s.next_tick)}</td></tr>`).join("") ||
    `<tr><td colspan="6" class="muted">No schedules.</td></tr>`}</tbody>
</table></div></div>
${ss.some((s) => s.cron == null) ? `<p class="muted small">Task, queue, cron and next tick show when the dashboard is given the schedule configuration.</p>` : ""}`;
}

/* ---------- workflows ---------- */

const WF_CLS = { running: "RUNNING", paused: "paused", completed: "COMPLETED", failed: "FAILED", cancelled: "CANCELLED" };
const stepCounts = (steps) => STATES.filter((s) => steps && steps[s]).map((s) => badge(`${steps[s]} ${s.toLowerCase()}`, s, "step-count")).join(" ");

async function workflowsPage(m, p, ctx) {
  view.innerHTML = `<h1>Workflows</h1><p class="muted">Loading…</p>`;
  const d = await api("api/workflows?limit=50");
  if (ctx.stale()) return;
  const ws = d.workflows || [];
  view.innerHTML = `<h1>Workflows <span class="muted small">newest 50</span></h1>
<div class="card flush"><div class="scroll"><table data-testid="workflows-table" class="rows">
  <thead><tr><th class="num">ID</th><th>Name</th><th>Status</th><th>On error</th><th>Steps</th><th>Submitted</th></tr></thead>
  <tbody>${ws.map((w) => `<tr data-testid="workflow-row" data-id="${esc(w.id)}">
    <td class="num"><a href="#/workflows/${esc(w.id)}">${esc(w.id)}</a></td><td class="mono">${esc(w.name)}</td>
    <td>${badge(w.status, WF_CLS[w.status] || w.status, "wf-status")}</td><td>${esc(w.on_error)}</td>
    <td>${stepCounts(w.steps)}</td><td>${ago(w.submitted_at)}</td></tr>`).join("") ||
    `<tr><td colspan="6" class="muted">No workflows.</td></tr>`}</tbody>
</table></div></div>`;
  $("[data-testid=workflows-table]").onclick = (e) => {
    const tr = !e.target.closest("a") && e.target.closest("tr[data-id]");
    if (tr) go(`#/workflows/${tr.dataset.id}`);
  };
}

async function workflowPage(m, p, ctx) {
  const id = Number(m[1]);
  view.innerHTML = `<p class="muted">Loading workflow #${id}…</p>`;
  const load = async () => {
    const d = await api(`api/workflows/${id}`);
    if (!ctx.stale()) renderWorkflow(d, load);
  };
  await load();
}

function renderWorkflow(d, reload) {
  const w = d.workflow, steps = d.steps || [], edges = d.edges || [];
  const byStep = new Map(steps.map((s) => [s.step, s]));
  const parentsOf = new Map();
  for (const e of edges) {
    if (!parentsOf.has(e.child)) parentsOf.set(e.child, []);
    parentsOf.get(e.child).push(e);
  }
  // What a WAITING step waits for: its unfinished parents, and failed ones it needs.
  const waitText = (s) => {
    if (s.state !== "WAITING") return "";
    const ps = (parentsOf.get(s.step) || []).map((e) => [e, byStep.get(e.parent)]).filter(([, x]) => x);
    const open = ps.filter(([, x]) => !FINISHED.has(x.state));
    const bad = ps.filter(([e, x]) => FINISHED.has(x.state) && x.state !== "COMPLETED" && !e.allow_failed);
    const ref = ([, x]) => `#${x.step} ${esc(x.name)} (${esc(x.state)})`;
    const parts = [];
    if (open.length) parts.push(`waits for ${open.map(ref).join(", ")}`);
    if (bad.length) parts.push(`blocked by ${bad.map(ref).join(", ")}`);
    if (s.waiting) parts.push(`<span class="muted">${esc(s.waiting[0])} satisfied, ${esc(s.waiting[1])} unsatisfied of ${esc(s.required)} required</span>`);
    return parts.join("; ");
  };
  view.innerHTML = `<div class="crumbs"><a href="#/workflows">Workflows</a> / #${esc(w.id)}</div>
<h1>Workflow #${esc(w.id)} <span class="mono">${esc(w.name)}</span> ${badge(w.status, WF_CLS[w.status] || w.status, "workflow-status")}</h1>
<div class="actions" data-testid="workflow-actions">${btn("wf-cancel", "Cancel", "danger")}${btn("wf-pause", "Pause")}${btn("wf-resume", "Resume")}${btn("wf-retry", "Retry…")}</div>
<p>On error: <b>${esc(w.on_error)}</b> · submitted ${when(w.submitted_at)} · ${stepCounts(w.steps)}</p>
${d.truncated ? `<p class="warn-text" data-testid="truncated">Only the first ${steps.length} steps are shown.</p>` : ""}
<section class="card"><h2>Graph</h2><div class="graph-wrap">${graph(steps, edges)}</div>
  <p class="muted small">Dashed edges allow the parent to fail. Click a step to open its task.</p></section>
<section class="card flush"><div class="scroll"><table data-testid="steps-table" class="rows">
  <thead><tr><th class="num">Step</th><th>Name</th><th class="num">Task</th><th>State</th><th class="num">Parents</th><th class="num">Required</th><th>Waiting for</th></tr></thead>
  <tbody>${steps.map((s) => `<tr data-testid="step-row" data-step="${esc(s.step)}" data-task="${esc(s.task)}">
    <td class="num">${esc(s.step)}</td><td class="mono">${esc(s.name)}</td><td class="num"><a href="#/tasks/${esc(s.task)}">${esc(s.task)}</a></td>
    <td>${badge(s.state)}</td><td class="num">${num(s.parents)}</td><td class="num">${num(s.required)}</td><td class="wrap">${waitText(s)}</td></tr>`).join("")}</tbody>
</table></div></section>`;

  const open = (el) => el && el.dataset.task && go(`#/tasks/${el.dataset.task}`);
  $("[data-testid=workflow-graph]").onclick = (e) => open(e.target.closest("[data-testid=wf-step]"));
  $("[data-testid=workflow-graph]").onkeydown = (e) => e.key === "Enter" && open(e.target.closest("[data-testid=wf-step]"));
  $("[data-testid=steps-table]").onclick = (e) => !e.target.closest("a") && open(e.target.closest("tr[data-task]"));

  const act = async (action, body, text, danger = false) => {
    const form = await ask(`${cap(action)} workflow`, `<p data-testid="confirm-text">${cap(action)} workflow #${esc(w.id)} (${esc(w.name)}, ${esc(w.status)})?</p>${text}`, { ok: cap(action), danger });
    if (!form) return;
    try {
      const r = await post(`api/workflows/${w.id}/${action}`, body(form));
      notice(`Workflow #${w.id}: ${action} done${r && r.status ? `, status ${r.status}` : ""}`);
    } catch (e) {
      notice(`Workflow #${w.id}: ${action} refused: ${e.message}`, "err");
    }
    await reload().catch((e) => notice(e.message, "err"));
  };
  const none = () => ({});
  $("[data-testid=wf-cancel]").onclick = () => act("cancel", none, `<p class="muted small">Its unfinished steps are cancelled.</p>`, true);
  $("[data-testid=wf-pause]").onclick = () => act("pause", none, `<p class="muted small">No further steps start until it is resumed.</p>`);
  $("[data-testid=wf-resume]").onclick = () => act("resume", none, "");
  $("[data-testid=wf-retry]").onclick = () => act("retry", (f) => ({ downstream: f.elements.downstream.checked }),
    `<p class="muted small">Failed steps run again.</p><label class="inline"><input type="checkbox" name="downstream" data-testid="retry-downstream"> downstream too (also reset the steps after them)</label>`);
}

// The workflow graph: steps in columns by depth (longest path from a root), edges as curves.
function graph(steps, edges) {
  const BW = 168, BH = 42, GX = 56, GY = 14, P = 12;
  const ids = new Set(steps.map((s) => s.step));
  const links = edges.filter((e) => ids.has(e.parent) && ids.has(e.child));
  const kids = new Map(), pars = new Map(), indeg = new Map(steps.map((s) => [s.step, 0])), depth = new Map(steps.map((s) => [s.step, 0]));
  for (const e of links) {
    (kids.get(e.parent) || kids.set(e.parent, []).get(e.parent)).push(e.child);
    (pars.get(e.child) || pars.set(e.child, []).get(e.child)).push(e.parent);
    indeg.set(e.child, indeg.get(e.child) + 1);
  }
  const order = steps.filter((s) => indeg.get(s.step) === 0).map((s) => s.step);
  for (let i = 0; i < order.length; i++) {
    for (const c of kids.get(order[i]) || []) {
      depth.set(c, Math.max(depth.get(c), depth.get(order[i]) + 1));
      indeg.set(c, indeg.get(c) - 1);
      if (indeg.get(c) === 0) order.push(c);
    }
  }
  // Layers; within one, order by the mean row of the parents to keep edges short.
  const layers = [], row = new Map();
  for (const s of steps) (layers[depth.get(s.step)] ||= []).push(s);
  for (const layer of layers.filter(Boolean)) {
    const key = (s) => {
      const ps = (pars.get(s.step) || []).filter((x) => row.has(x));
      return ps.length ? ps.reduce((a, x) => a + row.get(x), 0) / ps.length : s.step;
    };
    layer.sort((a, b) => key(a) - key(b) || a.step - b.step).forEach((s, i) => row.set(s.step, i));
  }
  const rows = Math.max(1, ...layers.filter(Boolean).map((l) => l.length));
  const W = P * 2 + layers.length * (BW + GX) - GX, H = P * 2 + rows * (BH + GY) - GY;
  const pos = new Map();
  layers.forEach((layer, d) => {
    const off = ((rows - (layer || []).length) * (BH + GY)) / 2;
    (layer || []).forEach((s, i) => pos.set(s.step, [P + d * (BW + GX), P + off + i * (BH + GY)]));
  });
  const clip = (s, n) => (s.length > n ? s.slice(0, n - 1) + "…" : s);
  let svg = `<svg data-testid="workflow-graph" class="graph" width="${Math.max(W, 10)}" height="${Math.max(H, 10)}" viewBox="0 0 ${Math.max(W, 10)} ${Math.max(H, 10)}" role="img" aria-label="Workflow graph">
<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrow"/></marker></defs>`;
  for (const e of links) {
    const [x1, y1] = pos.get(e.parent), [x2, y2] = pos.get(e.child);
    const a = x1 + BW, b = y1 + BH / 2, c = x2, dd = y2 + BH / 2, mx = (a + c) / 2;
    svg += `<path class="edge${e.allow_failed ? " dashed" : ""}" data-testid="wf-edge" d="M${a},${b} C${mx},${b} ${mx},${dd} ${c},${dd}" marker-end="url(#arrow)"/>`;
  }
  for (const s of steps) {
    const [x, y] = pos.get(s.step);
    svg += `<g class="node st-${esc(s.state)}" data-testid="wf-step" data-step="${esc(s.step)}" data-task="${esc(s.task)}" tabindex="0" role="link" transform="translate(${x},${y})">
<title>step ${esc(s.step)}: ${esc(s.name)} (${esc(s.state)}), task #${esc(s.task)}</title>
<rect width="${BW}" height="${BH}" rx="6"/><text x="8" y="17" class="nm">${esc(clip(String(s.name), 22))}</text>
<text x="8" y="33" class="sub">#${esc(s.step)} · ${esc(s.state)}</text></g>`;
  }
  return svg + `</svg>`;
}

/* ---------- start ---------- */

refreshOverview().finally(() => {
  S.started = true;
  route(true);
  startSSE();
});
