// The page of `caravan report` (src/report/report.cpp embeds this file, report.css and
// Chart.js into one self-contained HTML file). It reads the data block the command wrote
// (<script type="application/json" id="caravan-data">) and draws:
//   runs:    a summary table; loss and test accuracy against step and wall-clock time;
//            throughput; the time of a step split into compute, recompute, swap stalls and
//            synchronization wait, with communication in flight beside it; tracked memory by
//            category over time; per-rank step times (skew); the configs side by side;
//   benches: the charts and table each bench in bench/ wrote (charts.json).
// Window state for tests and the PNG export: window.caravanReport = {ready, renderMs (data to
// charts), readyMs (navigation start to charts), charts, errors}; with #png in the address, every chart is also written as a PNG data URL into
// <pre id="caravan-png"> ("name.png base64" lines), which `caravan report --png` reads back.
(function () {
  "use strict";
  const state = { ready: false, renderMs: 0, readyMs: 0, charts: [], errors: [] };
  window.caravanReport = state;
  window.addEventListener("error", (e) => state.errors.push(String(e.message || e)));
  window.addEventListener("unhandledrejection", (e) => state.errors.push(String(e.reason)));

  const pngMode = window.location.hash === "#png";
  const palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22", "#17becf"];
  const color = (i) => palette[i % palette.length];
  const MiB = 1024 * 1024;

  // ---- helpers ------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }
  function slug(s) {
    return String(s).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "") || "chart";
  }
  function column(table, name) { return table && table[name] ? table[name] : null; }
  // Points {x, y} of two columns, skipping missing values; `f` maps y.
  function points(xs, ys, f) {
    const out = [];
    if (!xs || !ys) return out;
    for (let i = 0; i < xs.length && i < ys.length; ++i) {
      const x = xs[i], y = ys[i];
      if (x === null || y === null || !isFinite(x)) continue;
      const v = f ? f(y, i) : y;
      if (v === null || v === undefined || !isFinite(v)) continue;
      out.push({ x: x, y: v });
    }
    return out;
  }
  function median(values) {
    const v = values.filter((x) => x !== null && isFinite(x)).sort((a, b) => a - b);
    if (v.length === 0) return null;
    const m = v.length >> 1;
    return v.length % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
  }
  // Math.max(...values) overflows the stack past ~120,000 values; this does not.
  function maxOf(values) {
    let m = null;
    for (const v of values || []) if (v !== null && isFinite(v) && (m === null || v > m)) m = v;
    return m;
  }
  function last(values) {
    if (!values) return null;
    for (let i = values.length - 1; i >= 0; --i) if (values[i] !== null) return values[i];
    return null;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return Number(x).toFixed(digits === undefined ? 3 : digits);
  }
  function fmtBytes(b) {
    if (b === null || b === undefined || !isFinite(b)) return "–";
    if (b >= 1024 * MiB) return (b / 1024 / MiB).toFixed(2) + " GiB";
    return (b / MiB).toFixed(1) + " MiB";
  }

  // Fills the canvas white first, so a PNG has no transparent background.
  const whiteBackground = {
    id: "caravanWhiteBackground",
    beforeDraw(chart) {
      const ctx = chart.ctx;
      ctx.save();
      ctx.globalCompositeOperation = "destination-over";
      ctx.fillStyle = "#ffffff";
      ctx.fillRect(0, 0, chart.width, chart.height);
      ctx.restore();
    },
  };

  // One chart in `parent`. spec: {id, title, type ("line" | "bar"), datasets, xLabel, yLabel,
  // xLog, yLog, labels (bar), stacked, xType}.
  function chart(parent, spec) {
    let n = 0;
    for (const d of spec.datasets) n += d.data.filter((v) => v !== null).length;
    if (n === 0) return null;  // nothing to draw (e.g. a column no run has)
    const box = el("div", { class: "chart", id: "chart-" + spec.id });
    const canvas = el("canvas");
    box.append(canvas);
    parent.append(box);
    const isLine = spec.type !== "bar";
    const scale = (label, log, stacked, linear) => {
      const s = { title: { display: !!label, text: label || "" }, stacked: !!stacked,
                  beginAtZero: !!stacked };
      if (log) s.type = "logarithmic";
      else if (linear) s.type = "linear";
      return s;
    };
    const config = {
      type: spec.type || "line",
      data: { labels: spec.labels, datasets: spec.datasets },
      plugins: [whiteBackground],
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        devicePixelRatio: pngMode ? 2 : window.devicePixelRatio,
        parsing: isLine ? false : undefined,
        normalized: true,
        spanGaps: true,
        interaction: { mode: "nearest", intersect: false },
        plugins: {
          title: { display: true, text: spec.title, font: { size: 14 } },
          legend: { display: spec.datasets.length > 1 || !!spec.legend },
          decimation: { enabled: isLine, algorithm: "lttb", samples: 600 },
          tooltip: { enabled: !pngMode },
        },
        scales: {
          x: scale(spec.xLabel, spec.xLog, spec.stacked && !isLine, isLine),
          y: Object.assign(scale(spec.yLabel, spec.yLog, spec.stacked, false),
                           // Bars compare lengths: from zero, or 713 against 872 looks like 6x.
                           isLine || spec.yLog ? {} : { beginAtZero: true }),
        },
      },
    };
    if (spec.horizontal) {  // floating bars along x, one row per label (a timeline)
      config.options.indexAxis = "y";
      config.options.scales = {
        x: { type: "linear", beginAtZero: true,
             title: { display: !!spec.xLabel, text: spec.xLabel || "" } },
        y: { type: "category", title: { display: !!spec.yLabel, text: spec.yLabel || "" } },
      };
    }
    if (spec.tooltipLabel) config.options.plugins.tooltip.callbacks = { label: spec.tooltipLabel };
    if (isLine) {
      for (const d of spec.datasets) {
        d.borderWidth = d.borderWidth || 1.5;
        if (d.pointRadius === undefined) d.pointRadius = 0;
        d.backgroundColor = d.backgroundColor || d.borderColor;
      }
    }
    const c = new Chart(canvas, config);
    state.charts.push({ id: spec.id, title: spec.title, datasets: spec.datasets.length, points: n,
                        chart: c, canvas: canvas });
    return c;
  }
  function lineDataset(label, data, i, extra) {
    return Object.assign({ label: label, data: data, borderColor: color(i) }, extra || {});
  }

  function section(title, note) {
    const s = el("section", {}, el("h2", {}, title));
    if (note) s.append(el("p", { class: "note" }, note));
    document.getElementById("content").append(s);
    return s;
  }

  // Charts drawn for one run at a time (a selector), or for every run in PNG mode.
  function perRun(parent, runs, label, build) {
    if (runs.length === 0) return;
    if (pngMode || runs.length === 1) {
      runs.forEach((r) => build(parent, r));
      return;
    }
    const select = el("select", { "aria-label": label });
    runs.forEach((r, i) => select.append(el("option", { value: String(i) }, r.name)));
    const holder = el("div");
    parent.append(el("label", { class: "picker" }, label + " ", select), holder);
    const draw = () => {
      for (const c of state.charts.filter((c) => holder.contains(c.canvas))) c.chart.destroy();
      state.charts = state.charts.filter((c) => !holder.contains(c.canvas));
      holder.replaceChildren();
      build(holder, runs[Number(select.value)]);
    };
    select.addEventListener("change", draw);
    draw();
  }

  // ---- runs ---------------------------------------------------------------------------------
  function stepParts(r) {
    // Per-step medians over the run's train records (seconds). compute_s holds the forward,
    // backward and optimizer time, recomputation and swap stalls included: they are split out.
    const t = r.train;
    const get = (name) => median(column(t, name) || []);
    const compute = get("compute_s") || 0;
    const recompute = get("recompute_s") || 0;
    const swap = (get("swap_stall_s") || 0) + (get("weights_stall_s") || 0);
    return {
      compute: Math.max(0, compute - recompute - swap),
      recompute: recompute,
      swap: swap,
      wait: get("sync_wait_s") || 0,
      outstanding: get("comm_outstanding_s"),
    };
  }

  // `parts`: stepParts of each run.
  function summaryTable(runs, parts) {
    const head = ["run", "model", "sync", "workers", "steps", "final loss", "test accuracy",
                  "best accuracy", "samples/s (median)", "compute + wait per step", "peak tracked",
                  "peak RSS", "time"];
    const table = el("table", { class: "summary" });
    table.append(el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))));
    const body = el("tbody");
    runs.forEach((r, i) => {
      const t = r.train, e = r.eval;
      const p = parts[i];
      const acc = column(e, "accuracy") || [];
      const best = maxOf(acc);
      const peak = column(t, "mem_tracked_peak");
      const rss = column(t, "rss_bytes");
      const cells = [
        el("td", {}, el("span", { class: "swatch", style: "background:" + color(i) }), r.name),
        r.config["model.name"] || "–",
        column(t, "sent_bytes") ? r.config["sync.mode"] || "–" : "one process",
        r.workers || 1,
        last(column(t, "step")) || 0,
        fmt(last(column(t, "loss")), 4),
        acc.length ? fmt(100 * last(acc), 2) + "%" : "–",
        best !== null ? fmt(100 * best, 2) + "%" : "–",
        fmt(median(column(t, "samples_per_s") || []), 1),
        fmt(1000 * (p.compute + p.recompute + p.swap + p.wait), 1) + " ms",
        fmtBytes(maxOf(peak)),
        fmtBytes(maxOf(rss)),
        fmt(Math.max(last(column(t, "time_s")) || 0, last(column(e, "time_s")) || 0), 1) + " s",
      ];
      body.append(el("tr", {}, ...cells.map((c) => (c instanceof Node ? c : el("td", {}, c)))));
    });
    table.append(body);
    return table;
  }

  function configTable(runs) {
    const keys = new Set();
    runs.forEach((r) => Object.keys(r.config).forEach((k) => keys.add(k)));
    const sorted = [...keys].sort();
    const differs = (k) => new Set(runs.map((r) => r.config[k] === undefined ? "\u0000"
                                                                              : r.config[k])).size > 1;
    const table = el("table", { class: "config" });
    table.append(el("thead", {}, el("tr", {}, el("th", {}, "key"),
                                    ...runs.map((r) => el("th", {}, r.name)))));
    const body = el("tbody");
    for (const k of sorted) {
      const d = differs(k);
      const row = el("tr", { class: d ? "differs" : "same" }, el("td", {}, k),
                     ...runs.map((r) => el("td", {}, r.config[k] === undefined ? "–" : r.config[k])));
      body.append(row);
    }
    table.append(body);
    const nDiff = sorted.filter(differs).length;
    const toggle = el("input", { type: "checkbox" });
    toggle.checked = runs.length > 1 && nDiff > 0;
    const apply = () => table.classList.toggle("only-differing", toggle.checked);
    toggle.addEventListener("change", apply);
    apply();
    return [el("label", { class: "picker" }, toggle,
               ` only the ${nDiff} keys that differ (of ${sorted.length})`), table];
  }

  function renderRuns(runs) {
    const parts = runs.map(stepParts);  // medians over every record: once per run
    const s = section("Runs", null);
    s.append(summaryTable(runs, parts));
    for (const r of runs) {  // parallel.layout = auto: the layout's prediction against the run
      if (!r.layout) continue;
      const measured = median(column(r.train, "samples_per_s") || []);
      const predicted = r.layout.predicted_samples_per_s;
      s.append(el("p", {}, `${r.name}: layout ${r.layout.name} (parallel.layout = auto), ` +
                   `predicted ${fmt(predicted, 1)} samples/s, measured ${fmt(measured, 1)}` +
                   (measured && predicted ? ` (measured / predicted ${fmt(measured / predicted, 2)})`
                                          : "") + `; ${r.layout.reasons}`));
    }
    for (const r of runs) {
      for (const n of r.notes || []) s.append(el("p", { class: "warning" }, r.name + ": " + n));
    }

    const curves = section("Loss and accuracy", "Training loss is the mean over the workers at " +
                           "each logged step; test accuracy is measured at each evaluation. " +
                           "Wall-clock time is the run's training time (evaluation included).");
    const grid = el("div", { class: "grid" });
    curves.append(grid);
    const train = (r) => r.train;
    const lines = (xName, yName, table, f, extra) => runs.map((r, i) =>
      lineDataset(r.name, points(column(table(r), xName), column(table(r), yName), f), i, extra));
    chart(grid, { id: "loss-vs-step", title: "Training loss vs step", xLabel: "step",
                  yLabel: "loss", datasets: lines("step", "loss", train) });
    chart(grid, { id: "loss-vs-time", title: "Training loss vs wall-clock time",
                  xLabel: "seconds", yLabel: "loss", datasets: lines("time_s", "loss", train) });
    if (runs.some((r) => column(r.eval, "accuracy"))) {
      const ev = (r) => r.eval;
      const pct = (y) => 100 * y;
      chart(grid, { id: "accuracy-vs-step", title: "Test accuracy vs step", xLabel: "step",
                    yLabel: "accuracy (%)",
                    datasets: lines("step", "accuracy", ev, pct, { pointRadius: 2 }) });
      chart(grid, { id: "accuracy-vs-time", title: "Test accuracy vs wall-clock time",
                    xLabel: "seconds", yLabel: "accuracy (%)",
                    datasets: lines("time_s", "accuracy", ev, pct, { pointRadius: 2 }) });
    }
    chart(grid, { id: "throughput", title: "Throughput", xLabel: "step",
                  yLabel: "samples / s (all workers)",
                  datasets: lines("step", "samples_per_s", train) });

    // Time split: medians per step, one bar per run.
    const split = section("Where a step's time goes", "Medians per step over the logged " +
      "windows (rank 0). Compute is forward, backward and the optimizer without recomputation " +
      "and swap stalls; synchronization wait is the time blocked on the gradient exchange or the " +
      "strategy's after-step work: the communication that was not hidden. The second bar " +
      "(all-reduce, gossip, local SGD) is the time some exchange was outstanding, from its " +
      "launch until the trainer took its result: an upper bound on the communication itself, " +
      "so at most the part above the wait was hidden behind compute.");
    const ms = (f) => parts.map((p) => (f(p) === null ? null : 1000 * f(p)));
    const stack = (label, data, i, group) => ({ label: label, data: data, backgroundColor: color(i),
                                               stack: group });
    const datasets = [stack("compute", ms((p) => p.compute), 0, "step"),
                      stack("recompute", ms((p) => p.recompute), 1, "step"),
                      stack("swap stalls", ms((p) => p.swap), 2, "step"),
                      stack("synchronization wait", ms((p) => p.wait), 3, "step")];
    if (parts.some((p) => p.outstanding !== null)) {
      datasets.push(stack("exchange outstanding", ms((p) => p.outstanding), 4, "comm"));
    }
    const splitBox = el("div", { class: "grid" });
    split.append(splitBox);
    chart(splitBox, { id: "time-split", title: "Time per step, split", type: "bar",
                      labels: runs.map((r) => r.name), datasets: datasets, stacked: true,
                      yLabel: "milliseconds per step", legend: true });

    // Skew between ranks.
    const ranked = runs.filter((r) => column(r.train, "rank_compute_s"));
    if (ranked.length) {
      const skew = ranked.map((r) => {
        const rows = column(r.train, "rank_compute_s").filter((v) => v);
        const ratios = rows.map((v) => Math.max(...v) / Math.max(1e-12, Math.min(...v)));
        return median(ratios);
      });
      chart(splitBox, { id: "rank-skew", title: "Rank skew: slowest / fastest worker's compute",
                        type: "bar", labels: ranked.map((r) => r.name),
                        datasets: [{ label: "median ratio", data: skew,
                                     backgroundColor: ranked.map((r) => color(runs.indexOf(r))) }],
                        yLabel: "ratio (1 = balanced)" });
      const per = section("Per-rank step time", "Each worker's compute and synchronization wait " +
                          "per step over the logged windows. A rank whose compute stands out " +
                          "makes the others wait.");
      perRun(per, ranked, "run:", (parent, r) => {
        const steps = column(r.train, "step");
        const comp = column(r.train, "rank_compute_s");
        const wait = column(r.train, "rank_sync_wait_s");
        const n = maxOf(comp.filter((v) => v).map((v) => v.length));
        const ds = [];
        for (let k = 0; k < n; ++k) {
          ds.push(lineDataset("rank " + k + " compute",
                              points(steps, comp, (v) => 1000 * v[k]),
                              k));
          if (wait) {
            ds.push(lineDataset("rank " + k + " wait",
                                points(steps, wait, (v) => 1000 * v[k]),
                                k, { borderDash: [4, 3] }));
          }
        }
        const g = el("div", { class: "grid" });
        parent.append(g);
        chart(g, { id: "ranks-" + slug(r.name), title: "Per-rank time per step — " + r.name,
                   xLabel: "step", yLabel: "milliseconds per step", datasets: ds });
      });
    }

    // Pipelines: one step's actions on every stage.
    const piped = runs.filter((r) => r.pipeline_timeline);
    if (piped.length) {
      const tl = section("Pipeline: one step on every stage", "Each stage's actions in one " +
        "step of pipeline 0 (metrics.jsonl's pipeline_timeline record): forwards, backwards " +
        "(zb-h1: the input-gradient and the weight-gradient halves) and the time blocked in " +
        "receives; what is left blank is the stage idle in the bubble or sending. Times are " +
        "from each stage's own start of the step; the stages start after the previous step's " +
        "all-reduce, so their origins agree within a message's latency.");
      const kinds = [["F", "forward"], ["B", "backward"], ["Bi", "backward, input gradient"],
                     ["W", "backward, weight gradients"], ["recv-act", "receive activation"],
                     ["recv-grad", "receive gradient"]];
      perRun(tl, piped, "run:", (parent, r) => {
        const t = r.pipeline_timeline;
        const labels = t.stages.map((_, k) => "stage " + k);
        const ds = [];
        kinds.forEach(([kind, label], i) => {
          const data = [];
          t.stages.forEach((spans, k) => {
            for (const [a, m, start, end] of spans) {
              if (a === kind) data.push({ x: [1000 * start, 1000 * end], y: labels[k], mb: m });
            }
          });
          if (data.length) {
            ds.push({ label: label, data: data, backgroundColor: color(i), grouped: false });
          }
        });
        const g = el("div", { class: "grid" });
        parent.append(g);
        chart(g, { id: "pipeline-" + slug(r.name), type: "bar", horizontal: true,
                   title: "One step per stage — " + r.name + " (step " + t.step + ", " +
                          t.schedule + ", " + t.micro_batches + " micro-batches)",
                   labels: labels, datasets: ds, legend: true,
                   xLabel: "milliseconds from the stage's start of the step",
                   tooltipLabel: (c) => c.dataset.label + " " + c.raw.mb + ": " +
                     fmt(c.raw.x[0], 3) + "–" + fmt(c.raw.x[1], 3) + " ms" });
      });
    }

    // Memory.
    const mem = section("Memory", "Tracked bytes by category (memory/tracker.h: activations " +
                        "as the peak over the window; weights, gradients and optimizer state " +
                        "live) and the process's resident set, on rank 0, against wall-clock time.");
    const memGrid = el("div", { class: "grid" });
    mem.append(memGrid);
    chart(memGrid, { id: "memory-peak", title: "Peak tracked memory vs time", xLabel: "seconds",
                     yLabel: "MiB", datasets: lines("time_s", "mem_tracked_peak", train,
                                                    (y) => y / MiB) });
    chart(memGrid, { id: "memory-rss", title: "Resident set vs time", xLabel: "seconds",
                     yLabel: "MiB", datasets: lines("time_s", "rss_bytes", train,
                                                    (y) => y / MiB) });
    // Stacked: the categories add up to what a step needs at its activation peak.
    const categories = [["mem_weights", "weights"], ["mem_gradients", "gradients"],
                        ["mem_optimizer_state", "optimizer state"],
                        ["mem_activations_peak", "activations (peak)"]];
    perRun(mem, runs, "run:", (parent, r) => {
      const ds = [];
      categories.forEach(([key, label], k) => {
        const col = column(r.train, key);
        if (col) {
          ds.push(lineDataset(label, points(column(r.train, "time_s"), col, (y) => y / MiB), k,
                              { fill: ds.length ? "-1" : "origin",
                                backgroundColor: color(k) + "55" }));
        }
      });
      const g = el("div", { class: "grid" });
      parent.append(g);
      chart(g, { id: "memory-" + slug(r.name), title: "Tracked memory by category — " + r.name,
                 xLabel: "seconds", yLabel: "MiB (stacked)", datasets: ds, legend: true,
                 stacked: true });
    });

    const cfg = section("Configs", "Each run's resolved config.toml.");
    cfg.append(...configTable(runs));
  }

  // ---- benches ------------------------------------------------------------------------------
  function renderBench(b) {
    const s = section(b.title || b.name, b.note || null);
    if (b.command) s.append(el("p", { class: "note" }, el("code", {}, b.command)));
    const grid = el("div", { class: "grid" });
    s.append(grid);
    (b.charts || []).forEach((c, k) => {
      const id = slug(b.name) + "-" + (c.id ? slug(c.id) : k);
      if (c.type === "bar") {
        chart(grid, { id: id, title: c.title, type: "bar", labels: c.labels, yLabel: c.y_label,
                      xLabel: c.x_label, yLog: c.log_y, stacked: c.stacked, legend: true,
                      datasets: c.series.map((ser, i) => ({ label: ser.name, data: ser.y,
                                                           backgroundColor: color(i) })) });
      } else {
        chart(grid, { id: id, title: c.title, xLabel: c.x_label, yLabel: c.y_label, xLog: c.log_x,
                      yLog: c.log_y, legend: true,
                      datasets: c.series.map((ser, i) => lineDataset(
                        ser.name, points(ser.x, ser.y), i,
                        { pointRadius: ser.x.length <= 50 ? 3 : 0,
                          borderDash: ser.dashed ? [5, 3] : undefined })) });
      }
    });
    if (b.table && b.table.columns) {
      const t = el("table", { class: "summary" });
      t.append(el("thead", {}, el("tr", {}, ...b.table.columns.map((h) => el("th", {}, h)))));
      const body = el("tbody");
      for (const row of b.table.rows || []) {
        body.append(el("tr", {}, ...row.map((v) => el("td", {}, v === null ? "–" : v))));
      }
      t.append(body);
      s.append(t);
    }
  }

  // ---- page ---------------------------------------------------------------------------------
  function exportPng() {
    const pre = el("pre", { id: "caravan-png" });
    const seen = new Map();
    const lines = [];
    for (const c of state.charts) {
      let name = c.id;
      const k = seen.get(name) || 0;
      seen.set(name, k + 1);
      if (k) name += "-" + (k + 1);
      const url = c.canvas.toDataURL("image/png");
      lines.push(name + ".png " + url.slice(url.indexOf(",") + 1));
    }
    pre.textContent = lines.join("\n");
    document.body.append(pre);
  }

  function main() {
    const t0 = performance.now();
    const data = JSON.parse(document.getElementById("caravan-data").textContent);
    document.title = data.title;
    document.getElementById("title").textContent = data.title;
    document.getElementById("generated").textContent =
      "Generated " + data.generated + " by caravan report from " +
      data.sources.length + " source" + (data.sources.length === 1 ? "" : "s") + ": " +
      data.sources.join(", ");
    if (pngMode) document.body.classList.add("png");
    if (data.runs.length) renderRuns(data.runs);
    for (const b of data.benches) renderBench(b);
    state.renderMs = performance.now() - t0;
    state.readyMs = performance.now();  // from navigation start
    state.ready = true;
    if (pngMode) exportPng();
  }
  try {
    main();
  } catch (e) {
    state.errors.push(String(e && e.stack ? e.stack : e));
    state.ready = true;
    const pre = el("pre", { id: "caravan-errors" }, state.errors.join("\n"));
    document.body.append(pre);
    throw e;
  }
  if (pngMode && state.errors.length) {
    document.body.append(el("pre", { id: "caravan-errors" }, state.errors.join("\n")));
  }
})();
