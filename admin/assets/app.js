// The review page: lists deliveries by state and acts on one. It talks only to this
// service's admin API with the token kept in this tab's session storage.
"use strict";
const STATES = ["in_review", "awaiting_approval", "approved", "parked", "sending", "sent", "failed", "rejected", "cancelled"];
const $ = (id) => document.getElementById(id);
const token = () => sessionStorage.getItem("airlock.token") || "";

async function api(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: { "authorization": "Bearer " + token(), "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error((data.error && data.error.code + ": " + data.error.message) || res.status);
  return data;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  Object.entries(attrs || {}).forEach(([k, v]) => (k === "onclick" ? (e.onclick = v) : e.setAttribute(k, v)));
  children.forEach((c) => e.append(c));
  return e;
}

async function refreshSwitch() {
  try {
    const s = await api("GET", "/admin/v1/send-enabled");
    $("switch").textContent = "send switch: " + (s.enabled ? "on" : "off");
    $("switch").className = "pill " + (s.enabled ? "on" : "off");
  } catch (e) { $("switch").textContent = "send switch: ?"; }
}

async function showList(state) {
  $("list").replaceChildren(el("p", { class: "muted" }, "loading…"));
  try {
    const page = await api("GET", "/admin/v1/deliveries?state=" + encodeURIComponent(state) + "&limit=100");
    const items = page.items.map((d) =>
      el("div", { class: "item", onclick: () => showDetail(d.id) },
        el("strong", {}, d.channel + " · " + d.state), el("br"),
        el("span", { class: "muted" }, d.agent + " · " + d.created_at)));
    $("list").replaceChildren(...(items.length ? items : [el("p", { class: "muted" }, "nothing " + state)]));
  } catch (e) { $("list").replaceChildren(el("p", { class: "error" }, String(e.message))); }
}

function act(label, fn) {
  return el("button", { onclick: async () => {
    try { await fn(); } catch (e) { alert(e.message); }
  } }, label);
}

async function showDetail(id) {
  const d = await api("GET", "/admin/v1/deliveries/" + id);
  const ask = (what) => { const r = prompt(what); if (r === null) throw new Error("cancelled"); return r; };
  const reload = () => showDetail(id);
  const actions = el("div", { class: "actions" });
  if (d.state === "in_review") actions.append(act("accept", async () => { await api("POST", `/admin/v1/deliveries/${id}/accept`, { note: ask("note") }); reload(); }));
  if (d.state === "awaiting_approval") actions.append(act("approve this version", async () => { await api("POST", `/admin/v1/deliveries/${id}/approve`, { artifact_sha256: d.artifact_sha256, note: ask("note") }); reload(); }));
  if (d.state === "in_review" || d.state === "awaiting_approval") actions.append(act("reject", async () => { await api("POST", `/admin/v1/deliveries/${id}/reject`, { reason: ask("reason") }); reload(); }));
  if (d.state === "parked") ["confirmed_sent", "resend", "cancel"].forEach((r) =>
    actions.append(act(r, async () => { await api("POST", `/admin/v1/deliveries/${id}/resolve`, { resolution: r, note: ask("note (check the relay for the Message-ID first)") }); reload(); })));
  $("detail").replaceChildren(
    el("h2", {}, d.channel + " · " + d.state),
    el("p", { class: "muted" }, "artifact " + d.artifact_sha256),
    actions,
    el("h3", {}, "score"), el("pre", {}, JSON.stringify(d.score, null, 2)),
    el("h3", {}, "artifact"), el("pre", {}, JSON.stringify(d.artifact, null, 2)),
    el("h3", {}, "receipt"), el("pre", {}, JSON.stringify(d.receipt, null, 2)),
    el("h3", {}, "events"), el("pre", {}, d.events.map((e) => `${e.at}  ${e.from || "-"} → ${e.to}  ${e.actor}  ${e.reason || ""}`).join("\n")));
}

$("login").onsubmit = (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("airlock.token", $("token").value.trim());
  $("token").value = "";
  refreshSwitch();
  showList("in_review");
};
$("states").replaceChildren(...STATES.map((s) => el("button", { onclick: () => showList(s) }, s)));
if (token()) { refreshSwitch(); showList("in_review"); }
