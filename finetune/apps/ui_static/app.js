// finetune ui: the page. Everything it shows comes from the server's JSON API (finetune/apps/ui_app.py).
"use strict";

const $ = (id) => document.getElementById(id);
const FIELDS = ["model_name_or_path", "dataset", "dataset_format", "method", "use_peft", "lora_r", "config",
  "max_steps", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length",
  "gradient_checkpointing", "eval_split_size", "logging_steps", "save_steps"];
const PLAN = ["devices_per_node", "accelerator", "device_memory"];
let selected = null, pollTimer = null, chatMessages = [];

async function api(path, body) {
  const opts = body === undefined ? {} : {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify(body)};
  const r = await fetch(path, opts);
  let data;
  try { data = await r.json(); } catch (e) { data = {error: await r.text()}; }
  return data;
}

function show(el, text) { el.textContent = text || ""; el.hidden = !text; }

function fmtBytes(n) {
  for (const [u, s] of [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) if (Math.abs(n) >= s) return (n / s).toFixed(2) + " " + u;
  return n + " B";
}

function choices() {
  const fields = {};
  for (const k of FIELDS) {
    const el = $(k);
    if (!el) continue;
    fields[k] = el.type === "checkbox" ? el.checked : el.value.trim();
  }
  const plan = {};
  for (const k of PLAN) plan[k] = $(k).value.trim();
  const options = {};
  document.querySelectorAll("#method-options [data-flag]").forEach((el) => {
    options[el.dataset.flag] = el.type === "checkbox" ? el.checked : el.value.trim();
  });
  return {fields, plan, options, extra: $("extra").value, name: $("run-name").value.trim()};
}

// ---- tabs

function openTab(name) {
  document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  document.querySelectorAll(".screen").forEach((s) => s.classList.toggle("active", s.id === name));
  if (name === "runs") loadRuns();
  if (name === "chat") loadChatRuns();
}
document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => openTab(b.dataset.tab)));

// ---- set up: info, plan, command, recipe, preview

async function loadInfo() {
  const info = await api("/api/info");
  $("roots").textContent = "roots: " + info.roots.join(", ") + " · runs: " + info.runs_dir;
  const fill = (id, items, first) => {
    $(id).innerHTML = (first ? `<option value="">${first}</option>` : "") +
      items.map((x) => `<option value="${x}">${x}</option>`).join("");
  };
  fill("method", info.methods);
  fill("config", info.presets);
  fill("dataset_format", info.formats);
  methodOptions = info.method_options;
  drawMethodOptions();
  $("models").innerHTML = info.models.map((x) => `<option value="${x}">`).join("");
  $("datasets").innerHTML = info.datasets.map((x) => `<option value="${x}">`).join("");
}

let methodOptions = {};
function drawMethodOptions() {
  // The chosen method's own flags (its registry entry), with its defaults.
  const opts = methodOptions[$("method").value] || [];
  $("method-options").innerHTML = opts.map((o) => o.bool
    ? `<label class="check" title="${esc(o.help)}"><input type="checkbox" data-flag="${o.name}" id="opt-${o.name}"${o.default ? " checked" : ""}> ${o.name}</label>`
    : `<label title="${esc(o.help)}">${o.name} <input data-flag="${o.name}" id="opt-${o.name}" value="${esc(Array.isArray(o.default) ? o.default.join(",") : String(o.default ?? ""))}"></label>`).join("");
  $("method-options").querySelectorAll("input").forEach((el) => {
    el.addEventListener("input", planSoon);
    el.addEventListener("change", planSoon);
  });
}
$("method").addEventListener("change", drawMethodOptions);

let planSeq = 0, planTimer = null;
function planSoon() { clearTimeout(planTimer); planTimer = setTimeout(updatePlan, 350); }

async function updatePlan() {
  const seq = ++planSeq;
  $("plan-fits").textContent = "…";
  const data = await api("/api/plan", choices());
  if (seq !== planSeq) return;  // a newer change is on its way
  if (data.error) {
    show($("plan-error"), data.error);
    $("plan-fits").textContent = "";
    $("plan-fits").className = "badge";
    $("plan-bars").innerHTML = "";
    $("plan-text").textContent = "";
    $("command").textContent = "";
    $("recipe").textContent = "";
    return;
  }
  show($("plan-error"), "");
  const p = data.plan;
  $("plan-fits").textContent = p.fits ? "fits" : "does not fit";
  $("plan-fits").className = "badge " + (p.fits ? "ok" : "bad");
  const limit = p.limits.device_memory, total = p.per_device_total;
  const scale = Math.max(limit, total);
  const rows = Object.entries(p.per_device).filter(([, v]) => v > 0).map(([k, v]) =>
    `<div class="bar"><span class="name">${k}</span><span class="track"><span class="fill" style="width:${100 * v / scale}%;display:block"></span></span><span class="val">${fmtBytes(v)}</span></div>`);
  rows.push(`<div class="bar total ${p.fits ? "" : "over"}"><span class="name"><b>total per device</b></span><span class="track"><span class="fill" style="width:${100 * total / scale}%;display:block"></span></span><span class="val"><b>${fmtBytes(total)}</b></span></div>`);
  rows.push(`<div class="bar"><span class="name">device memory</span><span class="track"><span class="fill" style="width:${100 * limit / scale}%;display:block;background:#adb5bd"></span></span><span class="val">${fmtBytes(limit)}</span></div>`);
  const rec = p.recommendation && p.recommendation.config ? `<p class="muted">recommendation: ${p.recommendation.flags}</p>` : "";
  $("plan-bars").innerHTML = `<div class="bars">${rows.join("")}</div>` +
    `<p class="muted">${p.model.model_type}, ${p.model.parameters.toLocaleString()} parameters (${p.model.trainable_parameters.toLocaleString()} trained) · ${p.job.strategy}</p>` + rec;
  $("plan-text").textContent = data.text;
  $("command").textContent = data.command;
  $("recipe").textContent = data.recipe;
}

document.querySelectorAll("#setup input, #setup select").forEach((el) => {
  if (el.id === "run-name") return;
  el.addEventListener("input", planSoon);
  el.addEventListener("change", planSoon);
});
$("run-name").addEventListener("change", planSoon);

$("copy-command").addEventListener("click", async () => {
  const text = $("command").textContent;
  try { await navigator.clipboard.writeText(text); } catch (e) {
    const r = document.createRange(); r.selectNodeContents($("command"));
    const s = window.getSelection(); s.removeAllRanges(); s.addRange(r); document.execCommand("copy");
  }
  $("copy-command").textContent = "Copied";
  setTimeout(() => { $("copy-command").textContent = "Copy"; }, 1200);
});

$("save-recipe").addEventListener("click", () => {
  const blob = new Blob([$("recipe").textContent], {type: "text/yaml"});
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = ($("run-name").value.trim() || "recipe") + ".yaml";
  a.click();
});

function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }

$("preview-btn").addEventListener("click", async () => {
  const c = choices();
  $("preview").innerHTML = '<p class="muted">tokenizing…</p>';
  const data = await api("/api/preview", {model_name_or_path: c.fields.model_name_or_path, dataset: c.fields.dataset,
    dataset_format: c.fields.dataset_format, max_seq_length: c.fields.max_seq_length, n: 3});
  if (data.error) { show($("preview-error"), data.error); $("preview").innerHTML = ""; return; }
  show($("preview-error"), "");
  $("preview").innerHTML = data.records.map((r) =>
    `<div class="rec"><div class="where">${esc(r.where)} · ${r.format} · ${r.tokens.length} tokens, ${r.trained} trained${r.truncated ? " · cut at the max" : ""}${r.dropped ? " · <b>dropped by training: no trained token left</b>" : ""}</div>` +
    `<div class="toks">${r.tokens.map(([t, on]) => `<span class="t${on ? " on" : ""}">${esc(t)}</span>`).join("")}</div></div>`
  ).join("") + `<p class="muted">${data.total} records in the file</p>`;
});

$("launch").addEventListener("click", async () => {
  $("launch").disabled = true;
  show($("launch-error"), "");
  const c = choices();
  const data = await api("/api/runs", c);
  $("launch").disabled = false;
  if (data.error) { show($("launch-error"), data.error); return; }
  selected = data.run.name;
  openTab("runs");
});

// ---- runs

async function loadRuns() {
  const data = await api("/api/runs");
  const body = $("runs-list").querySelector("tbody");
  body.innerHTML = data.runs.map((r) => {
    const loss = r.last_loss != null ? Number(r.last_loss).toFixed(4) : "";
    const step = r.step != null ? `${r.step}/${r.max_steps ?? "?"}` : "";
    const cls = r.status.split(" ")[0];
    return `<tr data-run="${r.name}" class="${r.name === selected ? "sel" : ""}"><td>${r.name}</td><td><span class="badge ${cls}">${r.status}</span></td><td>${step}</td><td>${loss}</td><td>${r.report ? '<a href="/api/runs/' + encodeURIComponent(r.name) + '/report/loss.png" target="_blank">loss.png</a>' : ""}</td></tr>`;
  }).join("");
  body.querySelectorAll("tr").forEach((tr) => tr.addEventListener("click", () => { selected = tr.dataset.run; loadRuns(); }));
  if (selected) pollRun();
}
$("refresh-runs").addEventListener("click", loadRuns);

function chart(curves) {
  const W = 640, H = 260, L = 56, R = 12, T = 12, B = 34;
  const pts = curves.train.concat(curves.eval);
  if (!pts.length) return '<p class="muted">no loss logged yet</p>';
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => T + (y1 - y) / (y1 - y0) * (H - T - B);
  let g = "";
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    g += `<line x1="${L}" x2="${W - R}" y1="${Y(y)}" y2="${Y(y)}" stroke="#edf0f4"/><text x="${L - 6}" y="${Y(y) + 4}" text-anchor="end" font-size="11" fill="#718096">${y.toFixed(3)}</text>`;
  }
  const every = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000].find((s) => (x1 - x0) / s <= 8) || 20000;
  for (let x = Math.ceil(x0 / every) * every; x <= x1; x += every) {
    g += `<text x="${X(x)}" y="${H - B + 16}" text-anchor="middle" font-size="11" fill="#718096">${x}</text>`;
  }
  g += `<text x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle" font-size="11" fill="#4a5568">optimizer step</text>`;
  const line = curves.train.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ");
  g += `<polyline id="train-line" points="${line}" fill="none" stroke="#3b5bdb" stroke-width="2"/>`;
  g += curves.train.map((p) => `<circle cx="${X(p[0])}" cy="${Y(p[1])}" r="2" fill="#3b5bdb"/>`).join("");
  if (curves.eval.length) {
    g += `<polyline points="${curves.eval.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ")}" fill="none" stroke="#f08c00" stroke-width="1.5" stroke-dasharray="4 3"/>`;
    g += curves.eval.map((p) => `<circle class="eval-point" cx="${X(p[0])}" cy="${Y(p[1])}" r="4" fill="#f08c00"/>`).join("");
  }
  g += `<rect x="${W - R - 150}" y="${T}" width="146" height="40" fill="#fff" stroke="#e2e8f0"/>` +
    `<line x1="${W - R - 140}" x2="${W - R - 116}" y1="${T + 13}" y2="${T + 13}" stroke="#3b5bdb" stroke-width="2"/><text x="${W - R - 110}" y="${T + 17}" font-size="11">train loss</text>` +
    `<circle cx="${W - R - 128}" cy="${T + 30}" r="4" fill="#f08c00"/><text x="${W - R - 110}" y="${T + 34}" font-size="11">eval loss</text>`;
  return `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" data-train="${curves.train.length}" data-eval="${curves.eval.length}">${g}</svg>`;
}

async function pollRun() {
  clearTimeout(pollTimer);
  if (!selected) return;
  const d = await api("/api/runs/" + encodeURIComponent(selected));
  if (d.error) { show($("run-error"), d.error); return; }
  $("no-run").hidden = true;
  $("run-card").hidden = false;
  $("run-title").textContent = d.name;
  const cls = d.status.split(" ")[0];
  $("run-status").textContent = d.status;
  $("run-status").className = "badge " + cls;
  const pr = d.progress || {};
  const frac = pr.step != null && pr.max_steps ? pr.step / pr.max_steps : 0;
  $("run-progress-bar").style.width = (100 * frac) + "%";
  $("run-progress").textContent = pr.step != null ? `step ${pr.step} of ${pr.max_steps}` : "starting…";
  const running = d.status === "running" || d.status === "stopping";
  $("stop").disabled = !running;
  $("resume").disabled = running || d.status === "finished";
  $("report").disabled = running || !d.curves.source;
  $("export-hf").disabled = running || !d.adapter;
  $("export-gguf").disabled = running || d.status !== "finished";
  $("chat-with").disabled = d.status !== "finished";
  $("chart").innerHTML = chart(d.curves);
  const log = $("run-log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 20;
  log.textContent = d.log;
  if (atEnd) log.scrollTop = log.scrollHeight;
  $("run-command").textContent = d.command || "";
  const m = d.metrics;
  $("metrics").innerHTML = m && m.train ? `<table><tr><th>first loss</th><th>last loss</th><th>eval loss</th><th>steps</th></tr>` +
    `<tr><td>${m.train.first_loss.toFixed(4)}</td><td id="last-loss">${m.train.last_loss.toFixed(4)}</td><td>${m.eval ? m.eval.eval_loss.toFixed(4) : ""}</td><td>${m.global_step}</td></tr></table>` : "";
  $("exports").innerHTML = Object.entries(d.exports || {}).map(([to, e]) =>
    `<p><b>export ${to}</b>: <span class="badge ${e.state.split(" ")[0] === "done" ? "ok" : e.state.startsWith("failed") ? "bad" : "running"}" id="export-${to}-state">${e.state}</span> ${esc(e.path)}</p><pre class="code">${esc(e.command)}</pre>` +
    (e.state.startsWith("failed") ? `<pre class="log">${esc(e.log)}</pre>` : "")).join("");
  $("report-images").innerHTML = (d.report_images || []).map((f) =>
    `<img src="/api/runs/${encodeURIComponent(d.name)}/report/${f}?t=${Date.now() >> 12}" alt="${f}">`).join("");
  const exporting = Object.values(d.exports || {}).some((e) => e.state === "running");
  const row = document.querySelector("#runs-list tr.sel");
  if (row) {  // the list's row follows the run
    row.children[1].innerHTML = `<span class="badge ${cls}">${d.status}</span>`;
    row.children[2].textContent = pr.step != null ? `${pr.step}/${pr.max_steps}` : "";
    const last = d.curves.train.length ? d.curves.train[d.curves.train.length - 1][1] : null;
    row.children[3].textContent = last != null ? Number(last).toFixed(4) : "";
  }
  if (running || exporting) pollTimer = setTimeout(pollRun, 1000);
}

async function runAction(action, body) {
  show($("run-error"), "");
  const d = await api(`/api/runs/${encodeURIComponent(selected)}/${action}`, body || {});
  if (d.error) show($("run-error"), d.error);
  await loadRuns();
}
$("stop").addEventListener("click", () => { $("stop").disabled = true; runAction("stop"); });
$("resume").addEventListener("click", () => runAction("resume"));
$("report").addEventListener("click", () => runAction("report"));
$("export-hf").addEventListener("click", () => runAction("export", {to: "hf"}));
$("export-gguf").addEventListener("click", () => runAction("export", {to: "gguf"}));
$("chat-with").addEventListener("click", () => { openTab("chat"); });

// ---- chat

async function loadChatRuns() {
  const data = await api("/api/runs");
  const done = data.runs.filter((r) => r.status === "finished").map((r) => r.name);
  const keep = selected && done.includes(selected) ? selected : $("chat-run").value;
  $("chat-run").innerHTML = done.map((n) => `<option value="${n}">${n}</option>`).join("");
  if (keep && done.includes(keep)) $("chat-run").value = keep;
}

function drawChat() {
  $("chat-log").innerHTML = chatMessages.map((m) => `<div class="msg ${m.role}">${esc(m.content) || "<i>(empty)</i>"}` +
    (m.note ? `<div class="note">${m.note}</div>` : "") + "</div>").join("");
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
}

async function send() {
  const text = $("chat-input").value.trim();
  if (!text) return;
  chatMessages.push({role: "user", content: text});
  $("chat-input").value = "";
  drawChat();
  $("chat-send").disabled = true;
  show($("chat-error"), "");
  const d = await api("/api/chat", {run: $("chat-run").value, messages: chatMessages.map((m) => ({role: m.role, content: m.content})),
    max_new_tokens: $("max_new_tokens").value, do_sample: $("do_sample").checked, temperature: $("temperature").value,
    seed: $("seed").value});
  $("chat-send").disabled = false;
  if (d.error) { chatMessages.pop(); show($("chat-error"), d.error); drawChat(); return; }
  chatMessages.push({role: "assistant", content: d.reply, note: `${d.completion_ids.length} tokens, ended by ${d.finish_reason}`});
  drawChat();
}
$("chat-send").addEventListener("click", send);
$("chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
$("chat-clear").addEventListener("click", () => { chatMessages = []; drawChat(); });
$("chat-run").addEventListener("change", () => { chatMessages = []; drawChat(); });

loadInfo().then(updatePlan);
