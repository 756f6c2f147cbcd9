// The dashboard page: polls /api/state once a second and redraws only what changed (no reload).
"use strict";

const POLL_MS = 1000;
const view = { version: null, figures: {}, filtersKey: "", samplesQuery: null, samplesVersion: null,
  samplesRequest: 0, open: new Set(), domains: [], domainsKey: "", picked: null, pickRequest: 0 };

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.appendChild(child);
  return node;
}

function setStatus(text, down) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("down", !!down);
}

async function poll() {
  try {
    const since = view.version === null ? "" : view.version;
    const response = await fetch(`/api/state?since=${since}`, { cache: "no-store" });
    const state = await response.json();
    if (state.panels) render(state);
    setStatus(`live · version ${state.version} · checked ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    setStatus(`server unreachable (${err.message}); retrying`, true);
  }
  setTimeout(poll, POLL_MS);
}

function render(state) {
  view.version = state.version;
  document.body.classList.toggle("multi", state.runs.length > 1);
  document.getElementById("runs").textContent = state.runs.join("  |  ");
  const holder = document.getElementById("panels");
  const nav = document.getElementById("nav");
  for (const panel of state.panels) {
    let card = document.getElementById(`panel-${panel.id}`);
    if (!card) {
      card = el("section", { class: "card", id: `panel-${panel.id}` }, [
        el("h2", { text: panel.title }), el("div", { class: "tables" }), el("div", { class: "charts" }),
      ]);
      holder.appendChild(card);
      nav.appendChild(el("a", { href: `#panel-${panel.id}`, text: panel.title }));
    }
    renderTables(card.querySelector(".tables"), panel.tables);
    const charts = card.querySelector(".charts");
    for (const chart of panel.charts) renderChart(charts, chart);
  }
  renderPicker(state.domains || []);
  if (!document.querySelector('#nav a[href="#panel-samples"]')) {
    nav.appendChild(el("a", { href: "#panel-samples", text: "Samples" }));
  }
  renderFilters(state.filters);
  refreshSamples();
}

// Runs of many domains: a searchable list of every domain; the chosen one's curves and held-out cells.
function renderPicker(domains) {
  const key = JSON.stringify(domains);
  if (key !== view.domainsKey) {
    view.domainsKey = key;
    view.domains = domains;
    document.getElementById("panel-domain").hidden = !domains.length;
    document.getElementById("domain-list").replaceChildren(...domains.map((d) => el("option", { value: d })));
    document.getElementById("domain-count").textContent = `${domains.length} domains`;
    if (domains.length && !document.querySelector('#nav a[href="#panel-domain"]')) {
      document.getElementById("nav").appendChild(el("a", { href: "#panel-domain", text: "One domain" }));
    }
  }
  if (view.picked) showDomain(view.picked);  // new data: redraw the chosen domain
}

async function showDomain(name) {
  view.picked = name;
  const request = ++view.pickRequest;
  const response = await fetch(`/api/domain?name=${encodeURIComponent(name)}`, { cache: "no-store" });
  const answer = await response.json();
  if (request !== view.pickRequest) return;
  const holder = document.getElementById("table-domain");
  if (answer.error) {
    holder.replaceChildren(el("p", { class: "muted", text: answer.error }));
    return;
  }
  const div = document.getElementById("chart-domain");
  Plotly.react(div, answer.figure.data, answer.figure.layout, { responsive: true, displaylogo: false });
  div.dataset.domain = name;
  renderTables(holder, [{ id: "domain-heldout", title: `${name}: held-out reward`, columns: answer.heldout.columns,
    rows: answer.heldout.rows }]);
}

function renderChart(holder, chart) {
  let div = document.getElementById(`chart-${chart.id}`);
  if (!div) {
    div = el("div", { class: "chart", id: `chart-${chart.id}` });
    holder.appendChild(div);
  }
  div.dataset.hasData = chart.has_data;
  const key = JSON.stringify(chart.figure);
  if (view.figures[chart.id] === key) return;
  view.figures[chart.id] = key;
  Plotly.react(div, chart.figure.data, chart.figure.layout, { responsive: true, displaylogo: false });
}

function renderTables(holder, tables) {
  holder.replaceChildren(...tables.map((t) => {
    const head = el("tr", {}, t.columns.map((c) => el("th", { text: c })));
    const rows = t.rows.length
      ? t.rows.map((r) => el("tr", {}, r.map((c) => el("td", { text: c }))))
      : [el("tr", {}, [el("td", { class: "muted", colspan: t.columns.length, text: "no data yet" })])];
    return el("div", { class: "table", id: `table-${t.id}` }, [
      el("h3", { text: t.title }), el("table", {}, [el("thead", {}, [head]), el("tbody", {}, rows)]),
    ]);
  }));
}

function renderFilters(filters) {
  const key = JSON.stringify(filters);
  if (key === view.filtersKey) return;
  view.filtersKey = key;
  for (const [id, values] of [["f-run", filters.runs], ["f-family", filters.families], ["f-domain", filters.domains],
    ["f-effort", filters.efforts]]) {
    const select = document.getElementById(id);
    const chosen = select.value;
    select.replaceChildren(el("option", { value: "", text: "any" }), ...values.map((v) => el("option", { value: v, text: v })));
    select.value = values.includes(chosen) ? chosen : "";
  }
}

function sampleQuery() {
  const params = new URLSearchParams({
    run: document.getElementById("f-run").value,
    family: document.getElementById("f-family").value,
    domain: document.getElementById("f-domain").value,
    effort: document.getElementById("f-effort").value,
    min_reward: document.getElementById("f-min").value,
    max_reward: document.getElementById("f-max").value,
    limit: "100",
  });
  return params.toString();
}

// Fetched again when the filters or the data changed; an answer overtaken by a newer request is dropped.
async function refreshSamples() {
  const query = sampleQuery();
  if (query === view.samplesQuery && view.version === view.samplesVersion) return;
  view.samplesQuery = query;
  view.samplesVersion = view.version;
  const request = ++view.samplesRequest;
  const response = await fetch(`/api/samples?${query}`, { cache: "no-store" });
  const answer = await response.json();
  if (request !== view.samplesRequest) return;
  const body = document.getElementById("samples-body");
  const count = document.getElementById("samples-count");
  if (answer.error) {
    count.textContent = answer.error;
    body.replaceChildren();
    return;
  }
  count.textContent = `${answer.rows.length} shown of ${answer.total} matching`;
  if (!answer.rows.length) {
    body.replaceChildren(el("tr", {}, [el("td", { class: "muted", colspan: 12, text: "no samples match" })]));
    return;
  }
  const rows = answer.rows.map(sampleRow);
  body.replaceChildren(...rows);
  for (const row of rows) {  // keep the transcripts the user opened open across redraws
    if (view.open.has(row.dataset.key)) showDetail(row);
  }
}

function fmt(x) {
  return typeof x === "number" ? String(Math.round(x * 1000) / 1000) : (x ?? "-");
}

function sampleRow(s) {
  const weights = [`v${fmt(s.version)}`];
  if (s.staleness !== null && s.staleness !== undefined) weights.push(`stale ${s.staleness}`);
  if (s.engine) weights.push(s.engine);
  const grade = s.error ? `error: ${s.error}` : s.grade;
  const cells = [s.run, s.step, s.domain, s.task_id, s.effort, s.reward, s.turns, s.tool_calls,
    `${fmt(s.tokens)}${s.truncated ? " (cut)" : ""}`, weights.join(" · "), grade, s.prompt];
  const names = ["run", "step", "domain", "task", "effort", "reward", "turns", "tools", "tokens", "weights", "grade", "prompt"];
  const row = el("tr", { class: `row ${s.passed ? "pass" : "fail"}`, "data-uid": s.uid, "data-run": s.run,
    "data-key": `${s.run}\n${s.uid}` }, cells.map((c, i) => el("td", { class: names[i], text: fmt(c) })));
  row.addEventListener("click", () => {
    const next = row.nextElementSibling;
    if (next && next.classList.contains("detail")) {
      next.remove();
      view.open.delete(row.dataset.key);
    } else {
      view.open.add(row.dataset.key);
      showDetail(row);
    }
  });
  return row;
}

async function showDetail(row) {
  const s = { run: row.dataset.run, uid: row.dataset.uid };
  const cell = el("td", { colspan: 12, text: "loading…" });
  const detail = el("tr", { class: "detail" }, [cell]);
  row.after(detail);
  const response = await fetch(`/api/sample?run=${encodeURIComponent(s.run)}&uid=${encodeURIComponent(s.uid)}`);
  const answer = await response.json();
  if (!answer.sample) {
    cell.textContent = answer.error;
    return;
  }
  const sample = answer.sample;
  const messages = (sample.transcript || []).map((m) => el("div", { class: `msg ${m.role}` }, [
    el("div", { class: "role", text: m.role }), el("pre", { text: m.content }),
  ]));
  const extra = { uid: sample.uid, env: sample.env, version: sample.version, versions: sample.versions,
    staleness: sample.staleness, engine: sample.engine, error: sample.error, grade: sample.grade };
  cell.replaceChildren(...messages, el("div", { class: "msg" }, [
    el("div", { class: "role", text: "grade and weights" }), el("pre", { text: JSON.stringify(extra, null, 1) }),
  ]));
}

for (const id of ["f-run", "f-family", "f-domain", "f-effort", "f-min", "f-max"]) {
  for (const event of ["input", "change"]) document.getElementById(id).addEventListener(event, refreshSamples);
}
document.getElementById("f-pick").addEventListener("input", (event) => {
  if (view.domains.includes(event.target.value)) showDomain(event.target.value);
});
poll();
