// Browser test of the Canter dashboard (headless Chromium through playwright-core).
//
// env: DASHBOARD_URL  the dashboard's base URL (e.g. http://127.0.0.1:8080/ or .../canter/)
//      FAILED_IDS     ids of >= 3 FAILED tasks named `fail` in queue `default` (comma-separated)
//      WORKFLOW_ID    id of a workflow
//      READ_ONLY=1    check only that a read-only dashboard offers no actions
//      SCREENSHOTS    directory for page screenshots (none when unset)
//      CHROMIUM       the browser (default /usr/bin/chromium)
//      DASHBOARD_USER, DASHBOARD_PASSWORD  basic-auth credentials, when the dashboard asks for them
// The database must hold queue `default` with PENDING `noop` tasks and the tasks above; the
// dashboard must not be read-only unless READ_ONLY=1. Exit 0 when every check passes, else 1.
import { chromium } from "playwright-core";
import { mkdirSync } from "node:fs";
import { join } from "node:path";

const T = 10_000; // per wait
const TOTAL = 180_000; // the whole run
const env = process.env;
const base = env.DASHBOARD_URL ? (env.DASHBOARD_URL.endsWith("/") ? env.DASHBOARD_URL : env.DASHBOARD_URL + "/") : null;
const readOnly = env.READ_ONLY === "1";
const failedIds = (env.FAILED_IDS || "").split(",").map((s) => s.trim()).filter(Boolean);
const workflowId = (env.WORKFLOW_ID || "").trim();
const shots = env.SCREENSHOTS || "";
const tid = (id) => `[data-testid="${id}"]`;
const ACTIONS = ["bulk-cancel", "bulk-retry", "bulk-delete", "bulk-cancel-all", "bulk-retry-all", "bulk-delete-all",
  "select-all", "task-check", "act-cancel", "act-retry", "act-reschedule", "act-complete", "act-fail", "act-delete",
  "pause", "resume", "wf-cancel", "wf-pause", "wf-resume", "wf-retry"].map(tid).join(", ") + ", button.action, input.action";

function usage(msg) {
  console.error(`dashboard.spec: ${msg}`);
  process.exit(1);
}
if (!base) usage("set DASHBOARD_URL");
if (!readOnly && failedIds.length < 3) usage("set FAILED_IDS to at least 3 ids of FAILED tasks");
if (!readOnly && !workflowId) usage("set WORKFLOW_ID");

let passed = 0;
const pageErrors = [];
const browser = await chromium.launch({ executablePath: env.CHROMIUM || "/usr/bin/chromium", args: ["--no-sandbox"] });
const httpCredentials = env.DASHBOARD_USER ? { username: env.DASHBOARD_USER, password: env.DASHBOARD_PASSWORD || "" } : undefined;
const page = await browser.newPage({ viewport: { width: 1360, height: 900 }, httpCredentials });
page.setDefaultTimeout(T);
page.on("pageerror", (e) => pageErrors.push(e.message));
const watchdog = setTimeout(() => finish(`the run took over ${TOTAL / 1000} s`), TOTAL);

async function finish(failure) {
  clearTimeout(watchdog);
  if (failure) {
    console.log(`FAIL: ${failure}`);
    if (shots) await page.screenshot({ path: join(shots, "failure.png"), fullPage: true }).catch(() => {});
  }
  await browser.close().catch(() => {});
  console.log(`${passed} passed, ${failure ? 1 : 0} failed`);
  process.exit(failure ? 1 : 0);
}

// Runs one named check; the first failure ends the run.
async function step(name, fn) {
  try {
    await fn();
    if (pageErrors.length) throw new Error(`script error in the page: ${pageErrors.join("; ")}`);
    passed++;
    console.log(`ok - ${name}`);
  } catch (e) {
    await finish(`${name}: ${e.message.split("\n")[0]}`);
  }
}

async function waitFor(selector, what, state = "visible") {
  try {
    await page.locator(selector).first().waitFor({ state, timeout: T });
  } catch {
    throw new Error(`${what} did not appear within ${T / 1000} s (${selector})`);
  }
}

// Polls fn until it returns a truthy value.
async function until(fn, what) {
  const end = Date.now() + T;
  let last;
  while (Date.now() < end) {
    try {
      last = await fn();
      if (last) return last;
    } catch (e) {
      last = e.message;
    }
    await page.waitForTimeout(150);
  }
  throw new Error(`${what} (not within ${T / 1000} s${last ? `; last: ${last}` : ""})`);
}

const open = async (hash) => {
  await page.goto(base + hash);
  await page.waitForLoadState("domcontentloaded");
};
const text = async (selector) => (await page.locator(selector).first().textContent({ timeout: T })).trim();
const noticeText = () => text(tid("notice")).catch(() => "");

async function screenshot(name) {
  if (!shots) return;
  mkdirSync(shots, { recursive: true });
  await page.waitForTimeout(200);
  await page.screenshot({ path: join(shots, name), fullPage: true });
}

// Opens the confirmation dialog with click(), checks its text, confirms.
async function confirm(click, expect) {
  await click();
  await waitFor(tid("dialog"), "the confirmation dialog");
  const body = await text(tid("dialog-body"));
  if (expect && !expect.test(body)) throw new Error(`the confirmation says "${body}", expected ${expect}`);
  await page.click(tid("confirm"));
  await waitFor(tid("dialog"), "the dialog closing", "hidden");
}

const rowIds = async () => page.$$eval(tid("task-row"), (rows) => rows.map((r) => r.dataset.id));

// The action controls a person could use now.
const usableActions = () => page.$$eval(ACTIONS, (els) => els
  .filter((e) => e.checkVisibility() && !e.disabled)
  .map((e) => e.dataset.testid || e.textContent.trim()));

async function noActions(where) {
  const bad = await usableActions();
  if (bad.length) throw new Error(`${where} offers actions though read-only: ${[...new Set(bad)].join(", ")}`);
}

if (readOnly) {
  await step("read-only badge shows", async () => {
    await open("#/");
    await waitFor(tid("readonly-badge"), "the read-only badge");
  });
  let someId = failedIds[0];
  await step("tasks page has no actions", async () => {
    await open("#/tasks");
    await waitFor(tid("tasks-table"), "the tasks table");
    await waitFor(tid("readonly-badge"), "the read-only badge");
    await noActions("the tasks page");
    someId ||= (await rowIds())[0];
    if (!someId) throw new Error("the database has no task to open");
  });
  await step("task detail has no actions", async () => {
    await open(`#/tasks/${someId}`);
    await waitFor(tid("task-state"), "the task's state");
    await noActions("the task page");
  });
  await step("queues page has no actions", async () => {
    await open("#/queues");
    await waitFor(tid("queues-row"), "a queue row");
    await noActions("the queues page");
  });
  if (workflowId) {
    await step("workflow page has no actions", async () => {
      await open(`#/workflows/${workflowId}`);
      await waitFor(tid("workflow-graph"), "the workflow graph");
      await noActions("the workflow page");
    });
  }
  await step("the API refuses actions with 403", async () => {
    const status = await page.evaluate(async () => (await fetch("api/admin", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ action: "pause", queue: "default" }),
    })).status);
    if (status !== 403) throw new Error(`POST api/admin answered ${status}, expected 403`);
  });
  await finish();
}

const [a, b, c] = failedIds;

await step("overview shows the default queue", async () => {
  await open("#/");
  await waitFor(`${tid("counts-table")} ${tid("queue-row")}[data-queue="default"]`, "the `default` row of the counts table");
  if (await page.locator(tid("readonly-badge")).isVisible()) throw new Error("the dashboard says read-only; this mode needs it writable");
});

await step("live indicator goes live (an SSE event arrived)", async () => {
  await waitFor(`${tid("live")}[data-state="live"]`, "the live indicator in state live");
});

await step("throughput chart is drawn", async () => {
  await waitFor(`svg${tid("throughput-chart")}`, "the throughput chart");
  await screenshot("overview.png");
});

await step("the state filter lists the FAILED tasks", async () => {
  await open("#/tasks");
  await waitFor(tid("tasks-table"), "the tasks table");
  await page.selectOption(tid("filter-state"), "FAILED");
  await page.click(tid("filter-apply"));
  await until(() => page.evaluate(() => location.hash.includes("state=FAILED")), "the filter went into the URL");
  await until(async () => {
    const rows = await page.$$eval(tid("task-row"), (rs) => rs.map((r) => [r.dataset.id, r.dataset.state]));
    const other = rows.filter(([, s]) => s !== "FAILED"), missing = failedIds.filter((id) => !rows.some(([r]) => r === id));
    if (other.length || missing.length) throw new Error(`missing ${missing.join(", ") || "none"}; not FAILED: ${other.map((r) => r.join(" ")).join(", ") || "none"}`);
    return true;
  }, `the list shows only FAILED tasks and includes ${failedIds.join(", ")}`);
  await screenshot("tasks.png");
});

await step("bulk Retry of two selected tasks", async () => {
  for (const id of [a, b]) await page.check(`${tid("task-row")}[data-id="${id}"] ${tid("task-check")}`);
  await until(async () => (await text(tid("selection-count"))).startsWith("2 "), "the selection count says 2");
  await confirm(() => page.click(tid("bulk-retry")), /\b2 selected tasks\b/);
  await until(async () => /done 2\b/.test(await noticeText()), 'the notice says "done 2"');
  await page.reload();
  await waitFor(tid("tasks-table"), "the tasks table after reload");
  const ids = await rowIds();
  if (ids.includes(a) || ids.includes(b)) throw new Error(`tasks ${a} and ${b} are still listed as FAILED: ${ids.join(", ")}`);
  if (!ids.includes(c)) throw new Error(`task ${c} is no longer listed as FAILED`);
});

await step("task detail shows the error and the attempts", async () => {
  await open(`#/tasks/${c}`);
  await until(async () => (await text(tid("task-state"))) === "FAILED", `task ${c}'s state badge says FAILED`);
  const code = await text(tid("error-code"));
  if (!code) throw new Error("no error code shown");
  const items = await page.locator(tid("timeline-item")).count();
  if (items < 3) throw new Error(`the timeline has ${items} items, expected enqueued + attempts + final state`);
  const attempts = await page.locator(`${tid("timeline")} ${tid("attempt-outcome")}`).count();
  if (attempts < 1) throw new Error("the timeline shows no attempt");
  await screenshot("task.png");
});

await step("Retry on the task page", async () => {
  await confirm(() => page.click(tid("act-retry")), new RegExp(`task #${c}\\b`));
  await until(async () => ["PENDING", "CLAIMED", "RUNNING", "COMPLETED"].includes(await text(tid("task-state"))),
    `task ${c}'s state badge leaves FAILED`);
  if (!/retry done/.test(await noticeText())) throw new Error(`the notice says "${await noticeText()}"`);
});

await step("pause and resume the default queue", async () => {
  await open("#/queues");
  const row = `${tid("queues-row")}[data-queue="default"]`;
  await waitFor(row, "the `default` queue row");
  if ((await page.getAttribute(row, "data-paused")) === "true") throw new Error("queue default is paused before the test");
  await confirm(() => page.click(`${row} ${tid("pause")}`), /\bdefault\b/);
  await until(async () => (await text(`${row} ${tid("paused-state")}`)) === "paused", "queue default shows paused");
  await screenshot("queues.png");
  await confirm(() => page.click(`${row} ${tid("resume")}`), /\bdefault\b/);
  await until(async () => (await text(`${row} ${tid("paused-state")}`)) === "active", "queue default shows active again");
});

await step("schedules and workflows pages render", async () => {
  await open("#/schedules");
  await waitFor(tid("schedules-table"), "the schedules table");
  await open("#/workflows");
  await waitFor(`${tid("workflow-row")}[data-id="${workflowId}"]`, `workflow ${workflowId} in the list`);
});

await step("workflow graph has one box per step", async () => {
  await open(`#/workflows/${workflowId}`);
  await waitFor(`svg${tid("workflow-graph")}`, "the workflow graph");
  const boxes = await page.locator(`${tid("workflow-graph")} ${tid("wf-step")}`).count();
  const rows = await page.locator(tid("step-row")).count();
  const steps = await page.evaluate(async (id) => (await (await fetch(`api/workflows/${id}`)).json()).steps.length, workflowId);
  if (!steps || boxes !== steps || rows !== steps) throw new Error(`${boxes} boxes and ${rows} rows for ${steps} steps`);
  await screenshot("workflow.png");
});

await finish();
