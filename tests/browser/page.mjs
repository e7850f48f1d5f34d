// The web page in a real browser: headless Chromium (Debian's) driven by playwright-core,
// against a real airlock the calling suite started. One scenario per run:
//
//   node tests/browser/page.mjs SCENARIO
//
// with AIRLOCK_PAGE_URL (the admin service's origin), AIRLOCK_CHROMIUM (the browser),
// the tokens and ids the scenario needs in AIRLOCK_PAGE_* variables, and optionally
// AIRLOCK_PAGE_SCREENSHOTS (a directory: the views are saved there as PNG files).
// Controls are found by role and accessible name, as a person with a screen reader finds
// them. Every wait is bounded; a failed check exits 1 naming it. The last line of stdout
// is a JSON object of what was measured, for the suite to check as well.

import { chromium } from "playwright-core";
import assert from "node:assert/strict";
import path from "node:path";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const ORIGIN = env("AIRLOCK_PAGE_URL");
const SHOTS = process.env.AIRLOCK_PAGE_SCREENSHOTS || "";
const WAIT = 15_000;

const browser = await chromium.launch({
  executablePath: env("AIRLOCK_CHROMIUM"),
  headless: true,
  // --no-sandbox: Chromium's own sandbox cannot start as root (the test machines run the
  // suites as root); the page under test is ours, served from loopback.
  args: ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});

/** A fresh context (its own session storage) and page that records every request. */
async function open() {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  page.setDefaultTimeout(WAIT);
  const requests = [];
  const dialogs = [];
  const errors = [];
  page.on("request", (r) => requests.push(r.url()));
  page.on("dialog", (d) => { dialogs.push(d.message()); d.dismiss().catch(() => {}); });
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(ORIGIN + "/");
  return { context, page, requests, dialogs, errors };
}

async function signIn(page, token) {
  await page.getByLabel("Token").fill(token);
  await page.getByRole("button", { name: "Sign in" }).click();
  await page.getByText(/^Signed in as /).waitFor();
}

/** Opens the action's dialog, writes the note and confirms. */
async function act(page, button, note) {
  await page.getByRole("button", { name: button, exact: true }).click();
  const dialog = page.getByRole("dialog");
  await dialog.getByLabel("Note").fill(note);
  await dialog.getByRole("button", { name: "Confirm" }).click();
  await dialog.waitFor({ state: "hidden" });
}

/** Saves the view (the whole page with `full`) when AIRLOCK_PAGE_SCREENSHOTS names a directory. */
async function shot(page, name, full = false) {
  if (SHOTS) await page.screenshot({ path: path.join(SHOTS, name + ".png"), fullPage: full });
}

/** No request of the page left its origin. */
function sameOrigin(requests) {
  for (const url of requests) assert.ok(url.startsWith(ORIGIN + "/"), `a request left the origin: ${url}`);
}

const OPERATOR_CONTROLS = ["Send switch", "Grants", "Suppressions", "Workers and queues", "Audit log"];

const scenarios = {
  // A reviewer accepts and approves an item; an operator turns sending on in the page.
  async review() {
    const subject = env("AIRLOCK_PAGE_SUBJECT");
    const r = await open();
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    await r.page.getByText("Signed in as rita (reviewer)").waitFor();
    // The queue row shows the subject; a click opens the item.
    const row = r.page.getByRole("link", { name: subject });
    await row.waitFor();
    // A reviewer has none of the operator's controls, anywhere on the page.
    for (const name of OPERATOR_CONTROLS) assert.equal(await r.page.getByRole("link", { name }).count(), 0, `reviewer sees ${name}`);
    assert.equal(await r.page.getByRole("switch").count(), 0, "reviewer sees a switch");
    await row.click();
    await r.page.getByRole("heading", { name: subject }).waitFor();
    await r.page.getByText("1 recipient in an unknown domain").waitFor();
    await act(r.page, "Accept", "checked the recipient");
    await r.page.getByText("Accepted.").waitFor();
    assert.equal(await r.page.locator("#item-state").textContent(), "awaiting_approval");
    await shot(r.page, "item", true);
    await act(r.page, "Approve", "reads well");
    await r.page.getByText("Approved.").waitFor();
    assert.equal(await r.page.locator("#item-state").textContent(), "approved");
    assert.equal(await r.page.getByRole("button", { name: "Approve" }).count(), 0);
    // Even by address, the reviewer gets no operator view.
    await r.page.goto(ORIGIN + "/#/switch");
    await r.page.getByRole("heading", { name: "Review queue" }).waitFor();
    assert.equal(await r.page.getByRole("switch").count(), 0, "reviewer reached the switch");
    sameOrigin(r.requests);
    assert.deepEqual(r.errors, []);

    const o = await open();
    await signIn(o.page, env("AIRLOCK_PAGE_OPERATOR"));
    await o.page.getByRole("link", { name: "Send switch" }).click();
    const toggle = o.page.getByRole("switch", { name: "Send switch" });
    assert.equal(await toggle.isChecked(), false);
    // Without a reason the switch does not move.
    await toggle.click();
    await o.page.getByText("Give a reason first").waitFor();
    assert.equal(await toggle.isChecked(), false);
    await o.page.getByLabel("Reason").fill("morning check done");
    await toggle.click();
    await o.page.getByText("Sending is on now.").waitFor();
    assert.equal(await o.page.getByRole("switch", { name: "Send switch" }).isChecked(), true);
    await o.page.getByRole("cell", { name: "morning check done" }).waitFor();
    await shot(o.page, "operator-switch");
    await o.page.getByRole("link", { name: "Workers and queues" }).click();
    await o.page.getByRole("heading", { name: "Queues", exact: true }).waitFor();
    await o.page.getByRole("table", { name: "Workers, live first" }).waitFor();
    await shot(o.page, "operator-fleet");
    // Pausing a queue from the page, and resuming it, each with a reason.
    await o.page.getByRole("button", { name: "Pause default" }).click();
    await o.page.getByRole("dialog").getByLabel("Reason").fill("scorer upgrade");
    await o.page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
    await o.page.getByText("Paused.").waitFor();
    await o.page.getByRole("cell", { name: "scorer upgrade" }).waitFor();
    await o.page.getByRole("button", { name: "Resume default" }).click();
    await o.page.getByRole("dialog").getByLabel("Reason").fill("upgrade done");
    await o.page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
    await o.page.getByText("Resumed.").waitFor();
    // A grant created and revoked in the page.
    await o.page.getByRole("link", { name: "Grants" }).click();
    const form = o.page.getByRole("form", { name: "New grant" });
    await form.getByLabel("Agent ids (comma-separated)").fill("agent-1");
    await form.getByLabel("Recipient domains or webhook origins (comma-separated)").fill("example.org");
    assert.match(await form.getByLabel("Expires at").inputValue(), /^\d{4}-\d\d-\d\dT\d\d:\d\d$/);
    await form.getByLabel("Reason").fill("weekly newsletter");
    await form.getByRole("button", { name: "Create grant" }).click();
    await o.page.getByText("Grant created.").waitFor();
    await o.page.getByRole("cell", { name: "live" }).waitFor();
    await o.page.getByRole("button", { name: "Revoke" }).click();
    await o.page.getByRole("dialog").getByLabel("Reason").fill("newsletter paused");
    await o.page.getByRole("dialog").getByRole("button", { name: "Confirm" }).click();
    await o.page.getByText("Revoked.").waitFor();
    await o.page.getByRole("cell", { name: "revoked" }).waitFor();
    await o.page.getByRole("link", { name: "Audit log" }).click();
    await o.page.getByRole("cell", { name: "grant.revoke" }).waitFor();
    sameOrigin(o.requests);
    assert.deepEqual(o.errors, []);
    return { reviewer_requests: r.requests.length, operator_requests: o.requests.length };
  },

  // An approval of a version that changed meanwhile is explained, not a bare error.
  async stale() {
    const subject = env("AIRLOCK_PAGE_SUBJECT");
    const r = await open();
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    await r.page.getByRole("link", { name: subject }).click();
    await r.page.getByRole("heading", { name: subject }).waitFor();
    // Someone else edits it while the page shows the old version.
    const edited = await fetch(ORIGIN + `/admin/v1/deliveries/${env("AIRLOCK_PAGE_ID")}/edit`, {
      method: "POST",
      headers: { authorization: "Bearer " + env("AIRLOCK_PAGE_OPERATOR"), "content-type": "application/json" },
      body: process.env.AIRLOCK_PAGE_EDIT,
    });
    assert.equal(edited.status, 200, await edited.text());
    await r.page.getByRole("button", { name: "Approve", exact: true }).click();
    const dialog = r.page.getByRole("dialog");
    await dialog.getByLabel("Note").fill("approving what I read");
    await dialog.getByRole("button", { name: "Confirm" }).click();
    await dialog.getByText(/this item changed after you opened it/).waitFor();
    await dialog.getByRole("button", { name: "Close" }).click();
    // The page now shows the new version and the edit's diff.
    await r.page.getByRole("heading", { name: "Edit against what the agent submitted" }).waitFor();
    assert.equal(await r.page.locator("#item-state").textContent(), "awaiting_approval");
    await shot(r.page, "item-edited", true);
    // The reviewer edits the new version in the page, then approves theirs.
    await r.page.getByRole("button", { name: "Edit", exact: true }).click();
    const edit = r.page.getByRole("dialog");
    await edit.getByLabel("Text").fill(env("AIRLOCK_PAGE_TEXT"));
    await edit.getByLabel("Note").fill("clearer wording");
    await edit.getByRole("button", { name: "Confirm" }).click();
    await r.page.getByText("Edited: review the new version").waitFor();
    await r.page.locator("pre.body", { hasText: env("AIRLOCK_PAGE_TEXT") }).waitFor();
    await act(r.page, "Approve", "approving my wording");
    await r.page.getByText("Approved.").waitFor();
    sameOrigin(r.requests);
    return {};
  },

  // A parked send settled from the "Parked" view, after finding it by its Message-ID.
  async parked() {
    const r = await open();
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    await r.page.getByRole("link", { name: "Parked" }).click();
    await r.page.getByText(env("AIRLOCK_PAGE_MESSAGE_ID")).waitFor();
    await r.page.getByRole("table", { name: "Attempts" }).waitFor();
    await shot(r.page, "parked");
    await act(r.page, "Confirmed sent", "found it in the relay log");
    await r.page.getByText("Confirmed sent: done.").waitFor();
    await r.page.getByText("Nothing is parked.").waitFor();
    sameOrigin(r.requests);
    return {};
  },

  // Model-written HTML in the subject and the body stays text.
  async xss() {
    const subject = env("AIRLOCK_PAGE_SUBJECT");
    const r = await open();
    await r.page.evaluate(() => { window.__pwned = 0; });
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    const row = r.page.getByRole("link", { name: subject });
    await row.waitFor();
    await row.click();
    await r.page.getByRole("heading", { name: subject }).waitFor();
    // The text shows as written: subject, text part, and the HTML part as its source.
    for (const text of env("AIRLOCK_PAGE_TEXTS").split("\u001f")) {
      await r.page.locator("pre", { hasText: text }).first().waitFor();
    }
    // Nothing of it became markup, and no script of it ran.
    const inert = await r.page.evaluate(() => ({
      pwned: window.__pwned,
      images: document.querySelectorAll("main img").length,
      scripts: [...document.scripts].map((s) => s.src),
      handlers: document.querySelectorAll("main [onerror], main [onload], main [onclick]").length,
    }));
    assert.deepEqual(inert, { pwned: 0, images: 0, scripts: [ORIGIN + "/app.js"], handlers: 0 });
    assert.deepEqual(r.dialogs, [], "a dialog opened");
    await r.page.getByRole("link", { name: "Review queue", exact: true }).click();
    await r.page.getByRole("link", { name: subject }).waitFor();
    assert.equal(await r.page.evaluate(() => window.__pwned), 0);
    sameOrigin(r.requests);
    return { inert };
  },

  // A reviewer grants a turn's call from the page.
  async grant() {
    const r = await open();
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    await r.page.getByRole("link", { name: "Runs and turns" }).click();
    const card = r.page.getByRole("article", { name: "Call of wire_money" });
    await card.waitFor();
    await card.getByText(env("AIRLOCK_PAGE_SHA")).waitFor();
    await card.locator("pre", { hasText: '"amount": 100' }).waitFor();
    assert.equal(await r.page.getByRole("button", { name: "Deny" }).count(), 1);
    await act(r.page, "Grant", "invoice 7 checked");
    await r.page.getByText("Granted: the turn resumes.").waitFor();
    await r.page.getByText("No call is waiting.").waitFor();
    // The run's replay log, from the list of runs.
    await r.page.getByRole("table", { name: "Runs, oldest first" }).getByRole("link").first().click();
    await r.page.getByRole("table", { name: "Replay log" }).getByRole("cell", { name: "model_output" }).first().waitFor();
    sameOrigin(r.requests);
    return {};
  },

  // With many items waiting, sign-in shows one page of the queue, loaded by one request.
  async paging() {
    const r = await open();
    const started = Date.now();
    await signIn(r.page, env("AIRLOCK_PAGE_REVIEWER"));
    await r.page.locator("tr.row").first().waitFor();
    await r.page.getByRole("button", { name: "Load more" }).waitFor();
    const usable_ms = Date.now() - started;
    await shot(r.page, "queue");
    const lists = () => r.requests.filter((u) => u.includes("/admin/v1/deliveries?")).length;
    const rows = () => r.page.locator("tr.row").count();
    const first = { requests: lists(), rows: await rows() };
    // j/k move the selection, Enter opens the selected row.
    await r.page.keyboard.press("j");
    await r.page.keyboard.press("j");
    await r.page.keyboard.press("k");
    const selected = await r.page.locator("tr.row.selected").getAttribute("data-id");
    const second = await r.page.locator("tr.row").nth(1).getAttribute("data-id");
    assert.equal(selected, second, "j j k selects the second row");
    await r.page.getByRole("button", { name: "Load more" }).click();
    await r.page.locator("tr.row").nth(99).waitFor();
    const more = { requests: lists(), rows: await rows() };
    await r.page.locator("tr.row").nth(1).click();
    await r.page.getByRole("button", { name: "Reject" }).waitFor();
    assert.ok(r.page.url().endsWith("#/item/" + second));
    await r.page.goto(ORIGIN + "/#/queue");
    await r.page.locator("tr.row").first().waitFor();
    await r.page.keyboard.press("j");
    await r.page.keyboard.press("Enter");
    await r.page.getByRole("button", { name: "Reject" }).waitFor();
    assert.ok(r.page.url().endsWith("#/item/" + second), "Enter opens the selected row");
    sameOrigin(r.requests);
    return { usable_ms, first, more };
  },
};

const name = process.argv[2];
let out;
try {
  assert.ok(scenarios[name], `no scenario ${name}`);
  out = await scenarios[name]();
} finally {
  await browser.close();
}
console.log(JSON.stringify({ scenario: name, ...out }));
