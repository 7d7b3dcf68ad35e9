// Opens a page of `caravan report` in headless Chromium (Debian's, driven by playwright-core)
// and checks that it drew: no console error, no uncaught exception, no request leaving the
// page, every chart with data, with elements Chart.js laid out for it and a canvas that is not
// blank (gridlines and titles alone ink about 5%; the bar is 0.2%, a smoke test). Prints one JSON line:
//   {ok, charts, loadMs, readyMs, renderMs, problems: [...]}
// loadMs is the wall-clock time from navigation to every chart drawn (the page's `ready`
// flag, then one animation frame), measured here; readyMs is the same from the page's own
// clock (performance.now() at ready, from navigation start).
//
//   node report/browser_check.mjs PAGE.html [--screenshot FILE.png] [--runs N]
//        [--chromium /usr/bin/chromium]
// Exit status: 0 when every check passed, 1 when one failed, 2 on bad usage.
import { chromium } from "playwright-core";
import { pathToFileURL } from "node:url";
import path from "node:path";

const args = process.argv.slice(2);
const opt = { screenshot: null, runs: 1, chromium: process.env.CARAVAN_CHROMIUM || "/usr/bin/chromium" };
let page_ = null;
for (let i = 0; i < args.length; ++i) {
  if (args[i] === "--screenshot") opt.screenshot = args[++i];
  else if (args[i] === "--runs") opt.runs = Number(args[++i]);
  else if (args[i] === "--chromium") opt.chromium = args[++i];
  else if (!page_) page_ = args[i];
  else { console.error("browser_check: unexpected argument " + args[i]); process.exit(2); }
}
if (!page_) { console.error("usage: browser_check.mjs PAGE.html [--screenshot F] [--runs N]"); process.exit(2); }

const problems = [];
const browser = await chromium.launch({
  executablePath: opt.chromium,
  // The flags this machine's closed network and root user need (docs/report.md).
  args: ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
let result = {};
try {
  const context = await browser.newContext({ viewport: { width: 1400, height: 1000 } });
  const page = await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") problems.push("console error: " + m.text()); });
  page.on("pageerror", (e) => problems.push("uncaught: " + e.message));
  const url = pathToFileURL(path.resolve(page_)).href;
  page.on("request", (r) => { if (!r.url().startsWith(url.split("#")[0]) && !r.url().startsWith("data:")) problems.push("request left the page: " + r.url()); });

  const t0 = Date.now();
  await page.goto(url, { waitUntil: "commit", timeout: 60000 });
  await page.waitForFunction(() => window.caravanReport && window.caravanReport.ready,
                             null, { timeout: 60000, polling: "raf" });
  await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => r())));
  const loadMs = Date.now() - t0;

  const charts = await page.evaluate(() => window.caravanReport.charts.map((c) => {
    // Elements Chart.js laid out for the data (points, bars): what it drew, not what it got.
    let elements = 0;
    for (let i = 0; i < c.chart.data.datasets.length; ++i) {
      elements += c.chart.getDatasetMeta(i).data.length;
    }
    // A canvas that drew: share of pixels that are not the white background.
    const ctx = c.canvas.getContext("2d");
    const { width, height } = c.canvas;
    const data = ctx.getImageData(0, 0, width, height).data;
    let ink = 0;
    for (let i = 0; i < data.length; i += 16) {
      if (data[i] < 245 || data[i + 1] < 245 || data[i + 2] < 245) ++ink;
    }
    return { id: c.id, datasets: c.datasets, points: c.points, elements: elements,
             width: width, height: height,
             ink: ink / (data.length / 16) };
  }));
  const info = await page.evaluate(() => ({ readyMs: window.caravanReport.readyMs,
                                            renderMs: window.caravanReport.renderMs,
                                            errors: window.caravanReport.errors }));
  for (const e of info.errors) problems.push("page error: " + e);
  if (charts.length === 0) problems.push("no charts");
  for (const c of charts) {
    if (c.points === 0) problems.push(`chart ${c.id} has no data`);
    if (c.elements === 0) problems.push(`chart ${c.id} drew no points or bars`);
    if (c.width === 0 || c.height === 0) problems.push(`chart ${c.id} has an empty canvas`);
    if (!(c.ink > 0.002)) problems.push(`chart ${c.id} looks blank (${(100 * c.ink).toFixed(2)}% ink)`);
  }
  const rows = await page.locator("table.summary").first().locator("tbody tr").count();
  if (rows !== opt.runs) problems.push(`summary table has ${rows} runs, expected ${opt.runs}`);
  if (opt.screenshot) await page.screenshot({ path: opt.screenshot, fullPage: true });
  result = { ok: problems.length === 0, charts: charts.length, loadMs: loadMs,
             readyMs: Math.round(info.readyMs), renderMs: Math.round(info.renderMs),
             chartList: charts.map((c) => `${c.id}:${c.points}`), problems: problems };
} catch (e) {
  problems.push(String(e && e.message ? e.message : e));
  result = { ok: false, problems: problems };
} finally {
  await browser.close();
}
console.log(JSON.stringify(result));
process.exit(result.ok ? 0 : 1);
