// The reviewers' and operators' page. It talks only to this service's admin API (same
// origin), with the bearer token kept in this tab's session storage: no cookie, so no
// cross-site request can act for the user. Everything a model, an agent or a user wrote is
// put on the page as text (textContent), never parsed as HTML.

const TOKEN_KEY = "airlock.token";
const PAGE = 50;
const OPERATOR_ROLES = ["operator", "admin"];

let me = null; // {name, role} of the signed-in principal

// ---------------------------------------------------------------- helpers

const $ = (id) => document.getElementById(id);

/** An element with attributes (`on…` become listeners) and children (strings become text). */
function h(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(method, path, body) {
  const headers = { authorization: "Bearer " + (sessionStorage.getItem(TOKEN_KEY) || "") };
  if (body !== undefined) headers["content-type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), credentials: "omit" });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) {
    const err = (data && data.error) || {};
    if (res.status === 401 && path !== "/admin/v1/me") signOut("Your token is no longer valid: sign in again.");
    throw new ApiError(res.status, err.code || "HTTP_" + res.status, err.message || res.statusText);
  }
  return data;
}

const isOperator = () => me && OPERATOR_ROLES.includes(me.role);
const q = (params) => new URLSearchParams(Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "")).toString();
const pretty = (v) => JSON.stringify(v, null, 2);

function age(at) {
  const s = Math.max(0, Math.round((Date.now() - Date.parse(at)) / 1000));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  if (s < 86400) return Math.floor(s / 3600) + " h";
  return Math.floor(s / 86400) + " d";
}

const time = (at) => (at ? h("time", { datetime: at, title: at }, new Date(at).toLocaleString()) : "—");
const score = (v) => (v === null || v === undefined ? "—" : Number(v).toFixed(2));

function errorText(e) {
  if (e instanceof ApiError) return e.code + ": " + e.message;
  return String(e && e.message ? e.message : e);
}

/** Replaces the view: nodes, arrays of nodes, and empty places (null, false) left out. */
function show(...nodes) {
  $("content").replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== false));
}

function flash(text, kind) {
  return h("p", { class: kind || "notice", role: kind === "error" ? "alert" : "status" }, text);
}

function table(caption, columns, rows) {
  return h("table", {},
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows));
}

/**
 * Asks for a note (or a reason) in a dialog and runs `action(note, fields)` on "Confirm".
 * The dialog stays open with the error when the action fails; `extra` adds fields above
 * the note (each `{id, label, value, multiline}`).
 */
function ask({ title, text, label = "Note", extra = [], action }) {
  const dialog = $("ask");
  $("ask-title").textContent = title;
  $("ask-text").textContent = text || "";
  $("ask-note-label").textContent = label;
  $("ask-note").value = "";
  $("ask-error").textContent = "";
  $("ask-fields").replaceChildren(...extra.map((f) => h("div", { class: "field" },
    h("label", { for: "ask-field-" + f.id }, f.label),
    f.multiline
      ? h("textarea", { id: "ask-field-" + f.id, rows: f.rows || 6 })
      : h("input", { id: "ask-field-" + f.id, type: "text" }))));
  for (const f of extra) $("ask-field-" + f.id).value = f.value ?? "";
  const form = $("ask-form");
  const opener = document.activeElement;
  form.onsubmit = async (ev) => {
    ev.preventDefault();
    const note = $("ask-note").value.trim();
    if (!note) {
      $("ask-error").textContent = label + " is required: it is recorded with the action.";
      $("ask-note").focus();
      return;
    }
    const fields = Object.fromEntries(extra.map((f) => [f.id, $("ask-field-" + f.id).value]));
    $("ask-confirm").disabled = true;
    try {
      await action(note, fields);
      dialog.close();
    } catch (e) {
      $("ask-error").textContent = e.explain || errorText(e);
    } finally {
      $("ask-confirm").disabled = false;
    }
  };
  $("ask-close").onclick = () => dialog.close();
  dialog.onclose = () => { if (opener && opener.isConnected) opener.focus(); };
  dialog.showModal();
  (extra.length ? $("ask-field-" + extra[0].id) : $("ask-note")).focus();
}

// ---------------------------------------------------------------- sign-in and navigation

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  $("app").hidden = true;
  $("sign-in").hidden = false;
  $("sign-out").hidden = true;
  $("whoami").textContent = "";
  $("sending").textContent = "sending: ?";
  $("sign-in-error").textContent = message || "";
  $("token").focus();
}

async function signIn() {
  try {
    me = await api("GET", "/admin/v1/me");
  } catch (e) {
    signOut(e.status === 401 ? "That token is not valid." : e.status === 403 ? "An agent token cannot use this page." : errorText(e));
    return;
  }
  $("sign-in").hidden = true;
  $("app").hidden = false;
  $("sign-out").hidden = false;
  $("whoami").textContent = "Signed in as " + me.name + " (" + me.role + ")";
  buildNav();
  refreshSending();
  route();
}

const VIEWS = [
  { hash: "#/queue", label: "Review queue", render: viewQueue },
  { hash: "#/parked", label: "Parked", render: viewParked },
  { hash: "#/turns", label: "Runs and turns", render: viewTurns },
  { hash: "#/switch", label: "Send switch", render: viewSwitch, operator: true },
  { hash: "#/grants", label: "Grants", render: viewGrants, operator: true },
  { hash: "#/suppressions", label: "Suppressions", render: viewSuppressions, operator: true },
  { hash: "#/fleet", label: "Workers and queues", render: viewFleet, operator: true },
  { hash: "#/audit", label: "Audit log", render: viewAudit, operator: true },
];

function buildNav() {
  // Views a role may not use are not on the page at all.
  const links = VIEWS.filter((v) => !v.operator || isOperator()).map((v) => h("a", { href: v.hash }, v.label));
  $("nav").replaceChildren(h("ul", {}, links.map((a) => h("li", {}, a))));
}

function route() {
  if (!me) return;
  const hash = location.hash || "#/queue";
  for (const a of $("nav").querySelectorAll("a")) {
    if (hash.startsWith(a.getAttribute("href"))) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  let m;
  if ((m = hash.match(/^#\/item\/([0-9a-f-]{36})$/))) return viewItem(m[1]);
  if ((m = hash.match(/^#\/run\/([0-9a-f-]{36})$/))) return viewRun(m[1]);
  const view = VIEWS.find((v) => v.hash === hash && (!v.operator || isOperator())) || VIEWS[0];
  view.render();
}

async function refreshSending() {
  try {
    const s = await api("GET", "/admin/v1/send-enabled");
    $("sending").textContent = "sending: " + (s.enabled ? "on" : "off");
    $("sending").className = "pill " + (s.enabled ? "on" : "off");
  } catch (e) {
    $("sending").textContent = "sending: ?";
  }
}

// ---------------------------------------------------------------- review queue

/** A list that pages through a route's cursor: one page now, the next on "Load more". */
function pagedList({ path, params, head, row, empty, caption }) {
  const body = h("tbody", {});
  const status = h("p", { class: "muted", role: "status" }, "Loading…");
  const more = h("button", { type: "button", hidden: true }, "Load more");
  let cursor = null;
  async function load() {
    more.disabled = true;
    try {
      const page = await api("GET", path + "?" + q({ ...params, limit: PAGE, cursor }));
      page.items.forEach((item) => body.append(row(item)));
      cursor = page.next;
      more.hidden = !cursor;
      status.textContent = body.children.length ? body.children.length + (cursor ? " shown, more waiting" : " in all") : empty;
    } catch (e) {
      status.textContent = errorText(e);
      status.className = "error";
    } finally {
      more.disabled = false;
    }
  }
  more.addEventListener("click", load);
  const t = h("table", {}, h("caption", {}, caption), h("thead", {}, h("tr", {}, head.map((c) => h("th", { scope: "col" }, c)))), body);
  return { element: h("div", {}, t, status, more), load, body };
}

function viewQueue() {
  const list = pagedList({
    path: "/admin/v1/deliveries",
    params: { state: "in_review,awaiting_approval" },
    caption: "Waiting for a reviewer, oldest first",
    head: ["Subject or URL", "Channel", "State", "Score", "Age"],
    empty: "Nothing waiting for review.",
    row: (d) => {
      const label = d.subject ?? d.url ?? "(no subject)";
      const tr = h("tr", { class: "row", "data-id": d.id },
        h("td", {}, h("a", { href: "#/item/" + d.id, class: "open" }, label)),
        h("td", {}, d.channel),
        h("td", {}, d.state.replace("_", " ")),
        h("td", { class: "num" }, score(d.score)),
        h("td", { class: "num" }, age(d.created_at)));
      tr.addEventListener("click", (ev) => { if (ev.target.tagName !== "A") location.hash = "#/item/" + d.id; });
      return tr;
    },
  });
  show(h("h2", {}, "Review queue"),
    h("p", { class: "muted" }, "Keys: j and k move through the rows, Enter opens one."),
    list.element);
  list.load().then(() => select(list.body, 0));
}

function select(body, index) {
  const rows = [...body.querySelectorAll("tr.row")];
  if (!rows.length) return;
  const i = Math.max(0, Math.min(rows.length - 1, index));
  rows.forEach((r, n) => r.classList.toggle("selected", n === i));
  const link = rows[i].querySelector("a.open");
  if (link && document.activeElement !== $("token")) link.focus({ preventScroll: false });
}

document.addEventListener("keydown", (ev) => {
  if (!me || ev.ctrlKey || ev.metaKey || ev.altKey) return;
  if ($("ask").open || ["INPUT", "TEXTAREA", "SELECT"].includes(document.activeElement.tagName)) return;
  const body = $("content").querySelector("tbody");
  if (!body || !body.querySelector("tr.row")) return;
  const rows = [...body.querySelectorAll("tr.row")];
  const current = rows.findIndex((r) => r.classList.contains("selected"));
  if (ev.key === "j") { select(body, current + 1); ev.preventDefault(); }
  else if (ev.key === "k") { select(body, current - 1); ev.preventDefault(); }
  else if (ev.key === "Enter" && current >= 0 && document.activeElement.tagName !== "A" && document.activeElement.tagName !== "BUTTON") {
    location.hash = "#/item/" + rows[current].dataset.id;
    ev.preventDefault();
  }
});

// ---------------------------------------------------------------- one delivery

/** Lines of `a` and `b` compared: each line kept (" "), removed ("-") or added ("+"). */
function diffLines(a, b) {
  const x = a.split("\n"), y = b.split("\n");
  const n = x.length, m = y.length;
  const lcs = Array.from({ length: n + 1 }, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--)
    lcs[i][j] = x[i] === y[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
  const out = [];
  let i = 0, j = 0;
  while (i < n && j < m) {
    if (x[i] === y[j]) { out.push([" ", x[i]]); i++; j++; }
    else if (lcs[i + 1][j] >= lcs[i][j + 1]) out.push(["-", x[i++]]);
    else out.push(["+", y[j++]]);
  }
  while (i < n) out.push(["-", x[i++]]);
  while (j < m) out.push(["+", y[j++]]);
  return out;
}

function artifactText(a) {
  if (!a) return "";
  if (a.email) {
    const e = a.email;
    return ["From: " + e.from, "To: " + (e.to || []).join(", "), "Cc: " + (e.cc || []).join(", "), "Subject: " + e.subject, "",
      e.text ?? "", ...(e.html ? ["", "[HTML part, as source]", e.html] : [])].join("\n");
  }
  if (a.webhook) return ["POST " + a.webhook.url, pretty(a.webhook.headers || {}), "", pretty(a.webhook.body)].join("\n");
  return pretty(a);
}

function artifactView(d) {
  const a = d.artifact || {};
  if (a.email) {
    const e = a.email;
    return h("section", { "aria-labelledby": "artifact-title" },
      h("h3", { id: "artifact-title" }, "The email"),
      h("dl", { class: "facts" },
        h("dt", {}, "From"), h("dd", {}, e.from),
        h("dt", {}, "To"), h("dd", {}, (e.to || []).join(", ") || "—"),
        h("dt", {}, "Cc"), h("dd", {}, (e.cc || []).join(", ") || "—"),
        h("dt", {}, "Subject"), h("dd", { class: "subject" }, e.subject)),
      h("h4", {}, "Text"), h("pre", { class: "body" }, e.text ?? "(no text part)"),
      e.html ? [h("h4", {}, "HTML part (its source, never rendered)"), h("pre", { class: "body" }, e.html)] : null);
  }
  if (a.webhook) {
    return h("section", { "aria-labelledby": "artifact-title" },
      h("h3", { id: "artifact-title" }, "The webhook call"),
      h("dl", { class: "facts" }, h("dt", {}, "URL"), h("dd", {}, a.webhook.url)),
      h("h4", {}, "Headers"), h("pre", {}, pretty(a.webhook.headers || {})),
      h("h4", {}, "Body"), h("pre", { class: "body" }, pretty(a.webhook.body)));
  }
  return h("pre", {}, pretty(a));
}

function deliveryActions(d, reload) {
  const actions = h("div", { class: "actions" });
  const post = (verb, body) => api("POST", `/admin/v1/deliveries/${d.id}/${verb}`, body);
  const button = (label, onclick) => actions.append(h("button", { type: "button", onclick }, label));
  if (d.state === "in_review") {
    button("Accept", () => ask({
      title: "Accept this version", text: "It moves on to approval; nothing is sent yet.",
      action: async (note) => { await post("accept", { note }); reload("Accepted."); },
    }));
  }
  if (d.state === "in_review" || d.state === "awaiting_approval") {
    const a = d.artifact || {};
    const extra = a.email
      ? [{ id: "subject", label: "Subject", value: a.email.subject }, { id: "text", label: "Text", value: a.email.text ?? "", multiline: true, rows: 10 }]
      : [{ id: "body", label: "Body (JSON)", value: pretty(a.webhook ? a.webhook.body : {}), multiline: true, rows: 10 }];
    button("Edit", () => ask({
      title: "Edit the artifact", text: "Your version replaces the agent's and needs an approval of its own.", extra,
      action: async (note, f) => {
        const next = structuredClone(a);
        if (next.email) { next.email.subject = f.subject; next.email.text = f.text; }
        else {
          try { next.webhook.body = JSON.parse(f.body); } catch (e) { throw new Error("Body: not valid JSON (" + e.message + ")"); }
        }
        await post("edit", { artifact: next, note });
        reload("Edited: review the new version, then approve it.");
      },
    }));
  }
  if (d.state === "awaiting_approval") {
    const shown = d.artifact_sha256;
    button("Approve", () => ask({
      title: "Approve this version",
      text: "You approve exactly the version shown (sha256 " + shown.slice(0, 12) + "…). It is sent once the send switch is on.",
      action: async (note) => {
        try {
          await post("approve", { artifact_sha256: shown, note });
        } catch (e) {
          if (e.code === "STALE_ARTIFACT") {
            e.explain = "Not approved: this item changed after you opened it (someone edited it), so the version you read is no longer the one that would be sent. Close this, read the new version and approve that one if it is right.";
            reload(null, e.explain);
          }
          throw e;
        }
        reload("Approved.");
      },
    }));
  }
  if (d.state === "in_review" || d.state === "awaiting_approval") {
    button("Reject", () => ask({
      title: "Reject", text: "Nothing of it is sent, ever.", label: "Note",
      action: async (note) => { await post("reject", { reason: note }); reload("Rejected."); },
    }));
  }
  if (d.state === "parked") actions.append(...resolutionButtons(d, reload).children);
  return actions;
}

function resolutionButtons(d, reload) {
  const box = h("div", { class: "actions" });
  const resolutions = [
    ["confirmed_sent", "Confirmed sent", "You checked at the relay (by the Message-ID) or the receiver that it arrived: it is recorded as sent, attested by you."],
    ["resend", "Resend", "You checked that it did not arrive: it is sent once more (a duplicate if it did arrive)."],
    ["cancel", "Cancel the send", "It is not sent again; the delivery ends cancelled."],
  ];
  for (const [resolution, label, text] of resolutions) {
    box.append(h("button", { type: "button", onclick: () => ask({
      title: label, text,
      action: async (note) => { await api("POST", `/admin/v1/deliveries/${d.id}/resolve`, { resolution, note }); reload(label + ": done."); },
    }) }, label));
  }
  return box;
}

async function viewItem(id, notice, problem) {
  let d;
  try {
    d = await api("GET", "/admin/v1/deliveries/" + id);
  } catch (e) {
    return show(h("h2", {}, "Delivery"), flash(errorText(e), "error"));
  }
  const reload = (done, trouble) => viewItem(id, done, trouble);
  const a = d.artifact || {};
  const title = a.email ? a.email.subject : a.webhook ? a.webhook.url : d.id;
  const s = d.score;
  show(
    h("p", {}, h("a", { href: "#/queue" }, "← Review queue")),
    h("h2", { class: "subject" }, title),
    notice ? flash(notice) : null,
    problem ? flash(problem, "error") : null,
    h("dl", { class: "facts" },
      h("dt", {}, "State"), h("dd", { id: "item-state" }, d.state),
      h("dt", {}, "Channel"), h("dd", {}, d.channel),
      h("dt", {}, "Agent"), h("dd", {}, d.agent),
      h("dt", {}, "Created"), h("dd", {}, time(d.created_at)),
      h("dt", {}, "Artifact sha256"), h("dd", { class: "mono" }, d.artifact_sha256),
      h("dt", {}, "Idempotency key"), h("dd", { class: "mono" }, d.idempotency_key),
      d.message_id ? [h("dt", {}, "Message-ID"), h("dd", { class: "mono" }, d.message_id)] : null),
    deliveryActions(d, reload),
    h("section", { "aria-labelledby": "score-title" },
      h("h3", { id: "score-title" }, "Score"),
      s ? [h("p", {}, "Score " + score(s.value) + (s.threshold !== undefined ? " (review below " + score(s.threshold) + ")" : "") + (s.scorer ? ", by " + s.scorer : "")),
        h("ul", {}, (s.reasons || []).map((r) => h("li", {}, typeof r === "string" ? r : pretty(r))))]
        : h("p", { class: "muted" }, "Not scored yet.")),
    artifactView(d),
    d.submitted_artifact ? h("section", { "aria-labelledby": "diff-title" },
      h("h3", { id: "diff-title" }, "Edit against what the agent submitted"),
      h("pre", { class: "diff" }, diffLines(artifactText(d.submitted_artifact), artifactText(d.artifact)).map(([k, line]) =>
        h("span", { class: k === "+" ? "add" : k === "-" ? "del" : "same" }, (k === " " ? "  " : k + " ") + line + "\n")))) : null,
    (d.attempts || []).length ? table("Send attempts", ["Started", "Worker", "Lease epoch", "Outcome", "Details"],
      d.attempts.map((t) => h("tr", {}, h("td", {}, time(t.started_at)), h("td", {}, t.worker ?? "—"), h("td", {}, t.lease_attempt ?? "—"),
        h("td", {}, t.outcome ?? "none recorded"), h("td", {}, t.detail ?? "—")))) : null,
    d.receipt ? [h("h3", {}, "Receipt"), h("pre", {}, pretty(d.receipt))] : null,
    table("History", ["At", "From", "To", "By", "Note"],
      (d.events || []).map((e) => h("tr", {}, h("td", {}, time(e.at)), h("td", {}, e.from ?? "—"), h("td", {}, e.to), h("td", {}, e.actor), h("td", {}, e.reason ?? "")))),
  );
}

// ---------------------------------------------------------------- parked

async function viewParked() {
  const box = h("div", {});
  show(h("h2", {}, "Parked"),
    h("p", {}, "A send that may or may not have reached the relay. Find it by its Message-ID (email) or idempotency key (webhook) at the other end before choosing."),
    box);
  try {
    const page = await api("GET", "/admin/v1/deliveries?" + q({ state: "parked", limit: PAGE }));
    if (!page.items.length) return box.replaceChildren(flash("Nothing is parked."));
    const details = await Promise.all(page.items.map((d) => api("GET", "/admin/v1/deliveries/" + d.id)));
    box.replaceChildren(...details.map((d) => h("article", { class: "card", "aria-label": d.subject ?? d.id },
      h("h3", {}, h("a", { href: "#/item/" + d.id }, (d.artifact && d.artifact.email && d.artifact.email.subject) || (d.artifact && d.artifact.webhook && d.artifact.webhook.url) || d.id)),
      h("dl", { class: "facts" },
        d.message_id ? [h("dt", {}, "Message-ID"), h("dd", { class: "mono" }, d.message_id)] : null,
        h("dt", {}, "Idempotency key"), h("dd", { class: "mono" }, d.idempotency_key),
        h("dt", {}, "Channel"), h("dd", {}, d.channel)),
      table("Attempts", ["Started", "Worker", "Outcome", "Details"], (d.attempts || []).map((t) =>
        h("tr", {}, h("td", {}, time(t.started_at)), h("td", {}, t.worker ?? "—"), h("td", {}, t.outcome ?? "unknown"), h("td", {}, t.detail ?? "—")))),
      resolutionButtons(d, (done) => viewParked().then(() => $("content").prepend(flash(done)))))));
    if (page.next) box.append(flash("More are parked than shown here: resolve these first."));
  } catch (e) {
    box.replaceChildren(flash(errorText(e), "error"));
  }
}

// ---------------------------------------------------------------- runs and turns

async function viewTurns(notice) {
  const auths = h("div", {}, flash("Loading…"));
  const waiting = h("div", {}, flash("Loading…"));
  const runs = pagedList({
    path: "/admin/v1/runs", params: {}, caption: "Runs, oldest first",
    head: ["Run", "Agent", "State", "Steps used", "Created"], empty: "No runs.",
    row: (r) => h("tr", {}, h("td", {}, h("a", { href: "#/run/" + r.id, class: "mono" }, r.id)), h("td", {}, r.agent), h("td", {}, r.state),
      h("td", { class: "num" }, r.budget && r.budget.used ? r.budget.used.steps : "—"), h("td", {}, time(r.created_at))),
  });
  show(h("h2", {}, "Runs and turns"), notice ? flash(notice) : null,
    h("h3", {}, "Calls waiting for authorization"), auths,
    h("h3", {}, "Runs waiting on an effect whose outcome is unknown"), waiting,
    h("h3", {}, "All runs"), runs.element);
  runs.load();
  try {
    const page = await api("GET", "/admin/v1/authorizations?" + q({ state: "pending", limit: PAGE }));
    auths.replaceChildren(...(page.items.length ? page.items.map((a) => h("article", { class: "card", "aria-label": "Call of " + a.tool_id },
      h("dl", { class: "facts" },
        h("dt", {}, "Tool"), h("dd", { class: "tool" }, a.tool_id),
        h("dt", {}, "Arguments sha256"), h("dd", { class: "mono" }, a.arguments_sha256),
        h("dt", {}, "Turn"), h("dd", { class: "mono" }, a.turn_id),
        h("dt", {}, "Run"), h("dd", {}, h("a", { href: "#/run/" + a.run_id, class: "mono" }, a.run_id))),
      h("h4", {}, "Exact arguments"), h("pre", { class: "body" }, pretty(a.arguments)),
      h("div", { class: "actions" },
        h("button", { type: "button", onclick: () => ask({
          title: "Grant this call", text: "The call runs once, with exactly these arguments (sha256 " + a.arguments_sha256.slice(0, 12) + "…).",
          action: async (note) => { await api("POST", `/admin/v1/authorizations/${a.id}/grant`, { arguments_sha256: a.arguments_sha256, note }); viewTurns("Granted: the turn resumes."); },
        }) }, "Grant"),
        h("button", { type: "button", onclick: () => ask({
          title: "Deny this call", text: "The call never runs; the model is told.",
          action: async (note) => { await api("POST", `/admin/v1/authorizations/${a.id}/deny`, { note }); viewTurns("Denied."); },
        }) }, "Deny")))) : [flash("No call is waiting.")]));
  } catch (e) {
    auths.replaceChildren(flash(errorText(e), "error"));
  }
  try {
    const page = await api("GET", "/admin/v1/runs?" + q({ state: "waiting", limit: PAGE }));
    const cards = [];
    for (const r of page.items) for (const p of r.pending || []) cards.push(effectCard(r, p, () => viewTurns("Resolved: the run is active again.")));
    waiting.replaceChildren(...(cards.length ? cards : [flash("No run waits on an unknown outcome.")]));
  } catch (e) {
    waiting.replaceChildren(flash(errorText(e), "error"));
  }
}

function effectCard(r, p, done) {
  const e = p.effect || {};
  const resolutions = [
    ["confirmed_done", "Confirmed done", "You checked that the write happened; its outcome is recorded as attested by you."],
    ["retry", "Retry", "One more attempt, with the same idempotency key (a duplicate if the first one happened)."],
    ["abandon", "Abandon", "The effect is recorded as failed; the agent is told."],
  ];
  return h("article", { class: "card", "aria-label": "Effect " + e.step_id },
    h("dl", { class: "facts" },
      h("dt", {}, "Run"), h("dd", {}, h("a", { href: "#/run/" + r.id, class: "mono" }, r.id)),
      h("dt", {}, "Step"), h("dd", { class: "mono" }, e.step_id),
      h("dt", {}, "Target"), h("dd", {}, e.target ?? "—"),
      h("dt", {}, "Description"), h("dd", {}, e.description ?? "—"),
      h("dt", {}, "Idempotency key"), h("dd", { class: "mono" }, e.idempotency_key ?? "—")),
    h("h4", {}, "Attempts"), h("pre", {}, pretty(p.attempts || [])),
    h("div", { class: "actions" }, resolutions.map(([resolution, label, text]) => h("button", { type: "button", onclick: () => ask({
      title: label, text,
      action: async (note) => { await api("POST", `/admin/v1/runs/${r.id}/effects/${encodeURIComponent(e.step_id)}/resolve`, { resolution, note }); done(); },
    }) }, label))));
}

async function viewRun(id) {
  let r;
  try {
    r = await api("GET", "/admin/v1/runs/" + id);
  } catch (e) {
    return show(h("h2", {}, "Run"), flash(errorText(e), "error"));
  }
  const cancel = isOperator() && ["active", "waiting"].includes(r.state)
    ? h("div", { class: "actions" }, h("button", { type: "button", onclick: () => ask({
      title: "Cancel this run", text: "Every later step and effect is refused.", label: "Reason",
      action: async (reason) => { await api("POST", `/admin/v1/runs/${id}/cancel`, { reason }); viewRun(id); },
    }) }, "Cancel run")) : null;
  show(h("p", {}, h("a", { href: "#/turns" }, "← Runs and turns")),
    h("h2", {}, "Run ", h("span", { class: "mono" }, r.id)),
    h("dl", { class: "facts" }, h("dt", {}, "State"), h("dd", {}, r.state), h("dt", {}, "Agent"), h("dd", {}, r.agent),
      h("dt", {}, "Epoch"), h("dd", {}, r.epoch), h("dt", {}, "Budget"), h("dd", {}, h("pre", {}, pretty(r.budget)))),
    cancel,
    table("Replay log", ["#", "Step", "Kind", "Recorded", "Data"], (r.steps || []).map((s) =>
      h("tr", {}, h("td", { class: "num" }, s.seq), h("td", { class: "mono" }, s.step_id), h("td", {}, s.kind), h("td", {}, time(s.recorded_at)), h("td", {}, h("pre", {}, pretty(s.data)))))),
    table("Effects", ["Step", "Class", "State", "Attempt", "Target"], (r.effects || []).map((e) =>
      h("tr", {}, h("td", { class: "mono" }, e.step_id), h("td", {}, e.effect_class), h("td", {}, e.state), h("td", { class: "num" }, e.attempt), h("td", {}, e.target ?? "—")))));
}

// ---------------------------------------------------------------- operator views

async function viewSwitch(notice) {
  const s = await api("GET", "/admin/v1/send-enabled").catch((e) => ({ error: e }));
  if (s.error) return show(h("h2", {}, "Send switch"), flash(errorText(s.error), "error"));
  const toggle = h("input", { type: "checkbox", role: "switch", id: "send-switch", "aria-describedby": "switch-help" });
  toggle.checked = !!s.enabled;
  const reason = h("input", { type: "text", id: "switch-reason", required: true, autocomplete: "off" });
  const problem = h("p", { class: "error", role: "alert" });
  toggle.addEventListener("change", async () => {
    const want = toggle.checked;
    if (!reason.value.trim()) {
      toggle.checked = !want;
      problem.textContent = "Give a reason first: every flip is audited.";
      reason.focus();
      return;
    }
    toggle.disabled = true;
    try {
      await api("PUT", "/admin/v1/send-enabled", { enabled: want, reason: reason.value.trim() });
      refreshSending();
      viewSwitch("Sending is " + (want ? "on" : "off") + " now.");
    } catch (e) {
      toggle.checked = !want;
      toggle.disabled = false;
      problem.textContent = errorText(e);
    }
  });
  const history = pagedList({
    path: "/admin/v1/audit", params: { action: "send_switch.set" }, caption: "History, newest first",
    head: ["At", "By", "Set to", "Reason"], empty: "Never flipped.",
    row: (e) => h("tr", {}, h("td", {}, time(e.at)), h("td", {}, e.actor), h("td", {}, e.data && e.data.enabled ? "on" : "off"), h("td", {}, e.reason ?? "")),
  });
  show(h("h2", {}, "Send switch"), notice ? flash(notice) : null,
    h("p", { id: "switch-help" }, "While off, approved deliveries wait and nothing is lost. Now: ", h("strong", {}, s.enabled ? "on" : "off"),
      ", set by " + s.updated_by + " (" + (s.reason || "") + ")."),
    h("div", { class: "field" }, h("label", { for: "switch-reason" }, "Reason"), reason),
    h("div", { class: "field switch" }, toggle, h("label", { for: "send-switch" }, "Send switch")),
    problem, history.element);
  history.load();
}

function formField(id, label, input) {
  input.id = id;
  return h("div", { class: "field" }, h("label", { for: id }, label), input);
}

const list = (s) => s.split(",").map((x) => x.trim()).filter(Boolean);

function viewGrants(notice) {
  const grants = pagedList({
    path: "/admin/v1/grants", params: {}, caption: "Grants, newest first",
    head: ["Channel", "Agents", "Scope", "Min score", "Used", "Expires", "State", ""], empty: "No grants.",
    row: (g) => h("tr", {}, h("td", {}, g.channel), h("td", {}, (g.agent_ids || []).join(", ")),
      h("td", {}, [...(g.recipient_domains || []), ...(g.webhook_origins || [])].join(", ")), h("td", { class: "num" }, score(g.min_score)),
      h("td", { class: "num" }, (g.uses ?? 0) + " / " + g.max_uses), h("td", {}, time(g.expires_at)), h("td", {}, g.revoked_at ? "revoked" : "live"),
      h("td", {}, g.revoked_at ? "" : h("button", { type: "button", onclick: () => ask({
        title: "Revoke this grant", text: "It stops approving at once.", label: "Reason",
        action: async (reason) => { await api("DELETE", `/admin/v1/grants/${g.id}?` + q({ reason })); viewGrants("Revoked."); },
      }) }, "Revoke"))),
  });
  const channel = h("select", {}, h("option", { value: "email" }, "email"), h("option", { value: "webhook" }, "webhook"));
  const agents = h("input", { type: "text" });
  const scope = h("input", { type: "text" });
  const min = h("input", { type: "number", min: 0, max: 1, step: "0.01", value: "0.9" });
  // A week from now, in the browser's time zone, as a starting point.
  const week = new Date(Date.now() + 7 * 86400e3);
  const expires = h("input", { type: "datetime-local", value: new Date(week.getTime() - week.getTimezoneOffset() * 60e3).toISOString().slice(0, 16) });
  const uses = h("input", { type: "number", min: 1, value: "100" });
  const reason = h("input", { type: "text" });
  const problem = h("p", { class: "error", role: "alert" });
  const form = h("form", { class: "panel", "aria-labelledby": "new-grant" },
    h("h3", { id: "new-grant" }, "New grant"),
    formField("grant-channel", "Channel", channel),
    formField("grant-agents", "Agent ids (comma-separated)", agents),
    formField("grant-scope", "Recipient domains or webhook origins (comma-separated)", scope),
    formField("grant-min", "Minimum score", min),
    formField("grant-expires", "Expires at", expires),
    formField("grant-uses", "Most uses", uses),
    formField("grant-reason", "Reason", reason),
    problem, h("button", { type: "submit" }, "Create grant"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { channel: channel.value, agent_ids: list(agents.value), min_score: Number(min.value),
      expires_at: expires.value ? new Date(expires.value).toISOString() : "", max_uses: Number(uses.value), reason: reason.value.trim() };
    if (channel.value === "email") body.recipient_domains = list(scope.value); else body.webhook_origins = list(scope.value);
    try {
      await api("POST", "/admin/v1/grants", body);
      viewGrants("Grant created.");
    } catch (e) {
      problem.textContent = errorText(e);
    }
  });
  show(h("h2", {}, "Grants"), notice ? flash(notice) : null,
    h("p", {}, "A grant approves matching deliveries without a human, within its scope, score, count and time; never one in review."),
    form, grants.element);
  grants.load();
}

async function viewSuppressions(notice) {
  const items = pagedList({
    path: "/admin/v1/suppressions", params: {}, caption: "Suppressed recipients",
    head: ["Address or domain", "Reason", "Since", ""], empty: "Nobody is suppressed.",
    row: (s) => h("tr", {}, h("td", {}, s.address ?? s.domain), h("td", {}, s.reason ?? ""), h("td", {}, time(s.created_at)),
      h("td", {}, h("button", { type: "button", onclick: () => ask({
        title: "Lift this suppression", text: "Deliveries to it may be sent again.", label: "Reason",
        action: async (reason) => { await api("DELETE", `/admin/v1/suppressions/${s.id}?` + q({ reason })); viewSuppressions("Lifted."); },
      }) }, "Lift"))),
  });
  const target = h("input", { type: "text" });
  const reason = h("input", { type: "text" });
  const problem = h("p", { class: "error", role: "alert" });
  const form = h("form", { class: "panel", "aria-labelledby": "new-suppression" },
    h("h3", { id: "new-suppression" }, "Suppress a recipient"),
    formField("suppress-target", "Address, or @domain", target),
    formField("suppress-reason", "Reason", reason),
    problem, h("button", { type: "submit" }, "Suppress"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const t = target.value.trim();
    const body = t.startsWith("@") ? { domain: t.slice(1), reason: reason.value.trim() } : { address: t, reason: reason.value.trim() };
    try {
      await api("POST", "/admin/v1/suppressions", body);
      viewSuppressions("Suppressed.");
    } catch (e) {
      problem.textContent = errorText(e);
    }
  });
  show(h("h2", {}, "Suppressions"), notice ? flash(notice) : null, form, items.element);
  items.load();
}

async function viewFleet(notice) {
  const queues = h("div", {}, flash("Loading…"));
  const workers = h("div", {}, flash("Loading…"));
  const depth = h("div", {}, flash("Loading…"));
  show(h("h2", {}, "Workers and queues"), notice ? flash(notice) : null,
    h("h3", {}, "Queues"), queues, h("h3", {}, "Workers"), workers, h("h3", {}, "Jobs by kind and state"), depth);
  try {
    const page = await api("GET", "/admin/v1/queues");
    queues.replaceChildren(table("Queues", ["Queue", "State", "Available", "Running", "Parked", "Reason", ""], page.items.map((qq) =>
      h("tr", {}, h("td", { class: "mono" }, qq.name), h("td", {}, qq.paused ? "paused" : "claiming"),
        h("td", { class: "num" }, qq.depth.available ?? 0), h("td", { class: "num" }, qq.depth.running ?? 0), h("td", { class: "num" }, qq.depth.parked ?? 0),
        h("td", {}, qq.reason ?? ""),
        h("td", {}, qq.name === "send" ? h("span", { class: "muted" }, "follows the send switch") : h("button", { type: "button", onclick: () => ask({
          title: (qq.paused ? "Resume " : "Pause ") + qq.name, label: "Reason",
          text: qq.paused ? "Workers claim from it again at once." : "Workers stop claiming from it; running jobs go on.",
          action: async (reason) => { await api("POST", `/admin/v1/queues/${encodeURIComponent(qq.name)}/${qq.paused ? "resume" : "pause"}`, { reason }); viewFleet(qq.paused ? "Resumed." : "Paused."); },
        }) }, qq.paused ? "Resume " + qq.name : "Pause " + qq.name))))));
  } catch (e) {
    queues.replaceChildren(flash(errorText(e), "error"));
  }
  try {
    const page = await api("GET", "/admin/v1/workers");
    workers.replaceChildren(table("Workers, live first", ["Worker", "Host", "Queues", "In flight", "Heartbeat", "Stopped"], page.items.map((w) =>
      h("tr", {}, h("td", { class: "mono" }, w.id), h("td", {}, w.host), h("td", {}, w.queues ? w.queues.join(", ") : "all"),
        h("td", { class: "num" }, w.in_flight + " / " + w.concurrency), h("td", {}, time(w.heartbeat_at)), h("td", {}, w.stopped_at ? time(w.stopped_at) : "—")))));
  } catch (e) {
    workers.replaceChildren(flash(errorText(e), "error"));
  }
  try {
    const page = await api("GET", "/admin/v1/jobs?limit=1");
    depth.replaceChildren(table("Jobs by kind and state", ["Kind", "State", "Count"], (page.counts || []).map((c) =>
      h("tr", {}, h("td", { class: "mono" }, c.kind), h("td", {}, c.state), h("td", { class: "num" }, c.count)))));
  } catch (e) {
    depth.replaceChildren(flash(errorText(e), "error"));
  }
}

function viewAudit() {
  const log = pagedList({
    path: "/admin/v1/audit", params: {}, caption: "Audit log, newest first",
    head: ["At", "Actor", "Role", "Action", "Target", "Reason"], empty: "Nothing audited yet.",
    row: (e) => h("tr", {}, h("td", {}, time(e.at)), h("td", {}, e.actor), h("td", {}, e.role), h("td", { class: "mono" }, e.action),
      h("td", { class: "mono" }, e.target_kind + " " + e.target_id), h("td", {}, e.reason ?? "")),
  });
  show(h("h2", {}, "Audit log"), log.element);
  log.load();
}

// ---------------------------------------------------------------- start

$("sign-in-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  $("token").value = "";
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  signIn();
});
$("sign-out").addEventListener("click", () => signOut("Signed out."));
window.addEventListener("hashchange", route);
if (sessionStorage.getItem(TOKEN_KEY)) signIn();
else $("token").focus();
