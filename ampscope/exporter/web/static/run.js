// The run page: /ranks, /health and /series of one run every 2 s (the FP8 layer table is
// fp8.js's, from the same /ranks and /health). The series is loaded in
// full once, then only the steps after the newest one seen (since_step), so a refresh of
// 64 ranks x 1024 steps moves a few KB, not the whole history.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const MAX_STEPS = 1024;
  const AXIS_SIZE = 70;
  // Steps and rank counts are integers: their axes tick every 1, 2 or 5 x 10^k only (uPlot's
  // own increments include 0.5, 2.5 ... and would put ticks at steps 2.5 and 7.5).
  const WHOLE_INCRS = Array.from({ length: 10 }, (_, k) => [1, 2, 5].map((m) => m * 10 ** k)).flat();
  const stepAxis = () => ({ label: "step", incrs: WHOLE_INCRS });
  const a = ampscope;
  const run = new URLSearchParams(location.search).get("id") || "";
  const base = a.runPath(run);

  let series = null;
  let seriesKey = null; // ranks and their restarts when the series was loaded in full
  let scalePlot = null;
  let skipsPlot = null;
  let lossPlot = null;
  let normPlot = null;
  let plottedRanks = null;
  let watches = new Set(); // ranks that run a watch: no loss scale, no line on the scale chart
  const heatmaps = {
    origin: new Heatmap(document.getElementById("origin-heatmap"), "#d32f2f"),
    local: new Heatmap(document.getElementById("local-heatmap"), "#f57c00"),
  };

  /** Distinct, dark-enough colours for any number of ranks (golden-angle hues). */
  function rankColor(index) {
    const h = (index * 137.508) % 360, s = 0.7, l = 0.42;
    const f = (n) => {
      const k = (n + h / 30) % 12;
      const c = l - s * Math.min(l, 1 - l) * Math.max(-1, Math.min(k - 3, 9 - k, 1));
      return Math.round(c * 255).toString(16).padStart(2, "0");
    };
    return `#${f(0)}${f(8)}${f(4)}`;
  }

  const rowKey = (row) => `${row.rank}/${row.device}`;

  function trim() {
    const extra = series.steps.length - MAX_STEPS;
    if (extra <= 0) return;
    const first = series.steps[extra];
    series.steps = series.steps.slice(extra);
    for (const column of ["scale", "loss", "grad_norm"]) {
      series[column] = series[column].map((row) => row.slice(extra));
    }
    const keep = (steps) => steps.filter((s) => s >= first);
    series.skipped = series.skipped.map(keep);
    series.backoffs = series.backoffs.map(keep);
    for (const kind of ["found_inf_local", "found_inf_origin"]) {
      for (const row of series[kind]) row.steps = keep(row.steps);
    }
  }

  /** Append a since_step answer; false when it does not fit (new ranks or devices). */
  function merge(delta) {
    if (delta.ranks.join() !== series.ranks.join()) return false;
    for (const kind of ["found_inf_local", "found_inf_origin"]) {
      const known = new Map(series[kind].map((row) => [rowKey(row), row]));
      if (delta[kind].some((row) => !known.has(rowKey(row)))) return false;
      for (const row of delta[kind]) known.get(rowKey(row)).steps.push(...row.steps);
    }
    series.steps.push(...delta.steps);
    for (const column of ["scale", "loss", "grad_norm"]) {
      delta[column].forEach((row, i) => series[column][i].push(...row));
    }
    // Spikes come whole with every answer: an origin outlier may be found late.
    series.spikes = delta.spikes;
    delta.skipped.forEach((steps, i) => series.skipped[i].push(...steps));
    delta.backoffs.forEach((steps, i) => series.backoffs[i].push(...steps));
    trim();
    return true;
  }

  /** Bring `series` up to date; returns whether it changed. */
  async function loadSeries(ranks) {
    const key = ranks.map((r) => `${r.rank}:${r.restarts}`).join(",");
    if (series !== null && key === seriesKey && series.steps.length) {
      const last = series.steps[series.steps.length - 1];
      const delta = await a.getJSON(`${base}/series?since_step=${last}&max_steps=${MAX_STEPS}`);
      const spikes = JSON.stringify(series.spikes);
      if (merge(delta)) return delta.steps.length > 0 || JSON.stringify(delta.spikes) !== spikes;
    }
    series = await a.getJSON(`${base}/series?max_steps=${MAX_STEPS}`);
    seriesKey = key;
    return true;
  }

  function chartWidth() {
    return Math.max(600, Math.min(document.querySelector("main").clientWidth - 10, 1360));
  }

  /** Indices (in series.ranks) of the ranks with a loss scale to draw. */
  function scalerRows() {
    return series.ranks.map((rank, i) => i).filter((i) => !watches.has(series.ranks[i]));
  }

  /** Whether any rank reports a loss or gradient norm (stats), so the charts have data. */
  function hasStats() {
    const any = (rows) => rows.some((row) => row.some((v) => v != null));
    return any(series.loss) || any(series.grad_norm);
  }

  /** A per-rank chart on a log10 axis, with ringed markers for spikes (one series per kind). */
  function statsPlot(target, label, marks) {
    const rows = series.ranks.map((rank, i) => i);
    return new uPlot(
      {
        width: chartWidth(), height: 240,
        scales: { x: { time: false }, y: { distr: 3, log: 10 } },
        axes: [stepAxis(), { label, size: AXIS_SIZE, values: (u, vs) => vs.map((v) => (v == null ? "" : v.toPrecision(2))) }],
        series: [
          { label: "step" },
          ...rows.map((i) => ({
            label: `rank ${series.ranks[i]}`, stroke: rankColor(i), width: 1.2, spanGaps: false,
            points: { show: false }, value: (u, v) => (v == null ? "-" : v.toPrecision(4)),
          })),
          ...marks.map(([name, color]) => ({
            label: name, stroke: color, width: 0, paths: () => null,
            points: { show: true, size: 11, width: 2, stroke: color, fill: "transparent" },
          })),
        ],
        legend: { show: rows.length <= 16 },
        cursor: { sync: { key: "ampscope-run" } },
      },
      [[]],
      document.getElementById(target),
    );
  }

  /** Per step, the value to ring for spikes of `kinds`: the spiking rank's own value in
   *  `column` (the largest when several ranks spiked at that step), else null. */
  function spikeMarks(column, kinds) {
    const index = new Map(series.steps.map((step, i) => [step, i]));
    const rowOf = new Map(series.ranks.map((rank, i) => [rank, i]));
    const marks = new Array(series.steps.length).fill(null);
    for (const entry of series.spikes || []) {
      if (!kinds.includes(entry.kind)) continue;
      const row = series[column][rowOf.get(entry.rank)];
      for (const step of entry.steps) {
        const i = index.get(step);
        const v = i === undefined || !row ? null : row[i];
        if (v != null && v > 0) marks[i] = Math.max(marks[i] ?? v, v);
      }
    }
    return marks;
  }

  function makePlots() {
    for (const plot of [scalePlot, skipsPlot, lossPlot, normPlot]) if (plot) plot.destroy();
    scalePlot = skipsPlot = lossPlot = normPlot = null;
    const width = chartWidth();
    lossPlot = statsPlot("loss-chart", "loss", [["loss spike", "#e65100"]]);
    normPlot = statsPlot("norm-chart", "grad norm",
      [["grad-norm spike", "#e65100"], ["origin outlier", "#6a1b9a"]]);
    const rows = scalerRows();
    const showLegend = rows.length <= 16;
    // A run of watches only has no scale: the note replaces the chart (see refresh()).
    if (rows.length) scalePlot = new uPlot(
      {
        width, height: 300,
        scales: { x: { time: false }, y: { distr: 3, log: 2 } },
        axes: [
          stepAxis(),
          { label: "loss scale", size: AXIS_SIZE, values: (u, values) => values.map((v) => (v == null ? "" : a.scaleText(v))) },
        ],
        series: [
          { label: "step" },
          ...rows.map((i) => ({
            label: `rank ${series.ranks[i]}`, stroke: rankColor(i), width: 1.5, spanGaps: false,
            points: { show: false }, value: (u, v) => a.scaleText(v),
          })),
        ],
        legend: { show: showLegend },
        cursor: { sync: { key: "ampscope-run" } },
      },
      [[]],
      document.getElementById("scale-chart"),
    );
    skipsPlot = new uPlot(
      {
        width, height: 160,
        scales: { x: { time: false }, y: { range: [0, Math.max(1, series.ranks.length)] } },
        axes: [stepAxis(), { label: "ranks", size: AXIS_SIZE, incrs: WHOLE_INCRS }],
        series: [
          { label: "step" },
          { label: "skipped", stroke: "#c62828", fill: "rgba(198,40,40,0.35)",
            paths: uPlot.paths.bars({ size: [0.9, 12] }), points: { show: false } },
          // Only a loss scaler backs off: a run of watches has nothing to show there.
          { label: "backed off", show: rows.length > 0, stroke: "#1565c0", width: 0,
            points: { show: true, size: 6, fill: "#1565c0" } },
        ],
        cursor: { sync: { key: "ampscope-run" } },
        // The skips chart is drawn for every run (the scale chart only when some rank has
        // a scale) and has the same width and y-axis size: the heatmaps share its x axis.
        hooks: { draw: [drawHeatmaps] },
      },
      [[]],
      document.getElementById("skips-chart"),
    );
    plottedRanks = plotKey();
  }

  function plotKey() { return `${series.ranks.join()}|${[...watches].join()}`; }

  function countPerStep(lists) {
    const index = new Map(series.steps.map((step, i) => [step, i]));
    const counts = new Array(series.steps.length).fill(0);
    for (const steps of lists) for (const step of steps) {
      const i = index.get(step);
      if (i !== undefined) counts[i] += 1;
    }
    return counts;
  }

  function drawCharts() {
    if (skipsPlot === null || plottedRanks !== plotKey()) makePlots();
    // A log axis cannot place 0; a rank at scale 0 shows as a gap (the table says 0).
    const scales = scalerRows().map((i) => series.scale[i].map((v) => (v > 0 ? v : null)));
    if (scalePlot) scalePlot.setData([series.steps, ...scales]);
    // Zero is drawn as nothing, not as a flat bar at the axis.
    const skipped = countPerStep(series.skipped).map((n) => (n > 0 ? n : null));
    const backoffs = countPerStep(series.backoffs).map((n) => (n > 0 ? n : null));
    skipsPlot.setData([series.steps, skipped, backoffs]);
    // A log axis cannot place 0 or a negative loss: those show as gaps.
    const positive = (rows) => rows.map((row) => row.map((v) => (v > 0 ? v : null)));
    document.getElementById("stats-section").hidden = !hasStats();
    lossPlot.setData([series.steps, ...positive(series.loss), spikeMarks("loss", ["loss"])]);
    normPlot.setData([series.steps, ...positive(series.grad_norm),
      spikeMarks("grad_norm", ["grad_norm"]), spikeMarks("grad_norm", ["origin_outlier"])]);
    document.getElementById("origin-empty").hidden = series.found_inf_origin.length > 0;
  }

  /** The heatmaps share the skips chart's x axis: drawn from its draw hook, so they use the
   *  scales uPlot committed (it applies setData asynchronously). */
  function drawHeatmaps(plot) {
    if (!series.steps.length) return;
    const ratio = window.devicePixelRatio || 1;
    const left = plot.bbox.left / ratio;
    const first = series.steps[0], last = series.steps[series.steps.length - 1];
    const layout = {
      total: plot.width,
      left,
      width: plot.bbox.width / ratio,
      steps: series.steps,
      xpos: (step) => (step < first || step > last ? null : left + plot.valToPos(step, "x")),
    };
    for (const [kind, heatmap] of Object.entries(heatmaps)) {
      const rows = series[`found_inf_${kind}`].map((row) => ({
        rank: row.rank, device: row.device, steps: row.steps, label: `rank ${row.rank} ${row.device}`,
      }));
      heatmap.draw(rows, layout);
    }
  }

  function drawVerdicts(health) {
    const badge = document.getElementById("run-status");
    badge.className = `badge ${health.status}`;
    badge.textContent = health.status;
    const items = health.verdicts.map((verdict) => {
      const li = a.el("li");
      li.dataset.rule = verdict.rule;
      li.dataset.status = verdict.status;
      li.append(a.badge(verdict.status), " ", a.el("span", { cls: "rule", text: verdict.rule }),
        " ", a.el("span", { cls: "summary", text: verdict.summary }));
      const details = a.el("details");
      details.append(a.el("summary", { text: "evidence and thresholds" }),
        a.el("pre", { text: JSON.stringify({ evidence: verdict.evidence, thresholds: verdict.thresholds }, null, 2) }));
      li.append(details);
      return li;
    });
    // Keep open <details> open across refreshes.
    const open = new Set([...document.querySelectorAll("#verdicts li")]
      .filter((li) => li.querySelector("details").open).map((li) => li.dataset.rule));
    for (const li of items) if (open.has(li.dataset.rule)) li.querySelector("details").open = true;
    document.getElementById("verdicts").replaceChildren(...items);
    document.getElementById("verdicts-section").hidden = false;
  }

  function drawRanks(ranks) {
    const rows = ranks.map((rank) => {
      const tr = a.el("tr");
      tr.dataset.rank = rank.rank;
      const t = rank.totals;
      a.cell(tr, rank.rank, "num");
      a.cell(tr, rank.node);
      const state = a.rankState(rank);
      const stateCell = tr.appendChild(a.el("td", { cls: "state-cell" }));
      stateCell.appendChild(
        a.el("span", { cls: `state ${state}`, text: state,
                        title: a.failureText(rank) || a.stopText(rank) }));
      const paused = a.pauseText(rank);
      // Past its limit the pause no longer holds the rank: the chip takes the stall's colour.
      const chip = state === "stalled" ? "state paused over" : "state paused";
      if (paused) stateCell.appendChild(a.el("span", { cls: chip, text: paused }));
      a.cell(tr, rank.step, "num");
      a.cell(tr, a.modeText(rank), "mode").title = a.setupText([rank]);
      // A watch's records say scale 1 and no backoffs or growths: that is no loss scale.
      const watch = a.isWatch(rank);
      a.cell(tr, watch ? "none" : a.scaleText(rank.scale), "num");
      a.cell(tr, `${t.skipped_steps} / ${t.steps}`, "num");
      a.cell(tr, watch ? "-" : t.backoffs, "num");
      a.cell(tr, watch ? "-" : t.growths, "num");
      for (const counts of [t.found_inf_local, t.found_inf_origin]) {
        const entries = Object.entries(counts);
        const each = entries.map(([d, n]) => `${d} ${n}`).join(", ");
        // Per device when there are few; the total, with the devices on hover, when many.
        const text = entries.length <= 2
          ? each || "-"
          : `${a.sum(entries.map(([, n]) => n))} on ${entries.length} devices`;
        a.cell(tr, text, "num").title = each;
      }
      const applied = t.nonfinite_applied || 0;
      const first = t.first_nonfinite_applied;
      a.cell(tr, applied, applied ? "num bad" : "num").title = first
        ? `first at step ${first.step}` : "";
      // Replica checks: how many agreed, or since when the group's replicas differ.
      const checks = rank.replica_checks;
      if (!checks) a.cell(tr, "-", "num");
      else if (!checks.diverged) a.cell(tr, `${checks.agree} agree`, "num replicas");
      else {
        a.cell(tr, `diverged since step ${checks.first_diverged_step}`, "num bad replicas").title =
          `ranks ${checks.ranks.join(", ")} differ in ${checks.parameters.join(", ")}`;
      }
      a.cell(tr, `${rank.seconds_since_report.toFixed(1)} s ago`, "num");
      return tr;
    });
    document.querySelector("#ranks tbody").replaceChildren(...rows);
    document.getElementById("ranks-section").hidden = false;

    const params = new Map();
    for (const rank of ranks) for (const p of rank.totals.nonfinite_params) {
      const entry = params.get(p.name) || { count: 0, ranks: [] };
      entry.count += p.count;
      entry.ranks.push(rank.rank);
      params.set(p.name, entry);
    }
    const top = [...params].sort((x, y) => y[1].count - x[1].count).slice(0, 10);
    document.querySelector("#params tbody").replaceChildren(...top.map(([name, entry]) => {
      const tr = a.el("tr");
      a.cell(tr, name);
      a.cell(tr, entry.count, "num");
      a.cell(tr, entry.ranks.join(", "));
      return tr;
    }));
    document.getElementById("params-section").hidden = top.length === 0;
  }

  /** The failed ranks, each with its exception, step and message, above everything else. */
  function drawFailures(ranks) {
    const failed = ranks.filter((rank) => a.failureText(rank));
    const items = failed.map((rank) => {
      const li = a.el("li");
      li.dataset.rank = rank.rank;
      const origin = rank.failure.origin_ranks;
      const named = rank.failure.kind !== "nonfinite_gradients" ? ""
        : origin === null ? " (origin not tracked)"
        : origin.length ? ` (origin rank(s) ${origin.join(", ")})`
        : " (no origin rank: its own gradients were finite)";
      li.append(a.el("strong", { text: `rank ${rank.rank}` }), ` (node ${rank.node}): `,
        a.el("span", { cls: "what", text: a.failureText(rank) + named }),
        a.el("span", { cls: "message", text: rank.failure.message }));
      return li;
    });
    document.getElementById("failures").replaceChildren(...items);
    document.getElementById("failure").hidden = items.length === 0;
  }

  async function refresh() {
    let ranks, health;
    try {
      [ranks, health] = await Promise.all([a.getJSON(`${base}/ranks`), a.getJSON(`${base}/health`)]);
    } catch (error) {
      if (error.status === 404) {
        document.getElementById("message").textContent =
          `This exporter holds no run "${run}" (it never reported, or retention dropped it).`;
        return;
      }
      throw error;
    }
    const changed = await loadSeries(ranks);
    const watching = new Set(ranks.filter(a.isWatch).map((r) => r.rank));
    const modesChanged = [...watching].join() !== [...watches].join();
    watches = watching;
    const noScale = ranks.length > 0 && ranks.every(a.isWatch);
    document.getElementById("setup").textContent = a.setupText(ranks);
    document.getElementById("no-scale").hidden = !noScale;
    document.getElementById("no-scale-text").textContent = a.setupText(ranks);
    document.getElementById("scale-section").hidden = noScale;
    document.getElementById("skips-title").textContent =
      ranks.some((r) => !a.isWatch(r)) ? "Skipped steps and backoffs" : "Skipped steps";
    document.getElementById("message").textContent =
      `${health.up} of ${health.ranks} rank(s) up; newest ${series.steps.length} held step(s) shown; ` +
      `refreshes every ${REFRESH_MS / 1000} s`;
    drawFailures(ranks);
    drawVerdicts(health);
    drawRanks(ranks);
    ampscopeFp8.draw(ranks, health);
    document.getElementById("charts").hidden = false;
    if (changed || modesChanged || skipsPlot === null) drawCharts();
  }

  function showTooltip(kind, event) {
    const tooltip = document.getElementById("tooltip");
    const box = event.target.getBoundingClientRect();
    const found = heatmaps[kind].hit(event.clientX - box.left, event.clientY - box.top);
    if (!found) { tooltip.hidden = true; return; }
    tooltip.textContent = `rank ${found.row.rank} ${found.row.device}, step ${found.step}: ` +
      (found.hit ? `inf/NaN (${kind})` : "finite");
    tooltip.style.left = `${event.clientX + 12}px`;
    tooltip.style.top = `${event.clientY + 12}px`;
    tooltip.hidden = false;
  }

  for (const kind of Object.keys(heatmaps)) {
    const canvas = heatmaps[kind].canvas;
    canvas.addEventListener("mousemove", (event) => showTooltip(kind, event));
    canvas.addEventListener("mouseleave", () => { document.getElementById("tooltip").hidden = true; });
  }
  window.addEventListener("resize", () => {
    if (skipsPlot === null) return;
    for (const plot of [scalePlot, skipsPlot, lossPlot, normPlot]) {
      if (plot) plot.setSize({ width: chartWidth(), height: plot.height });
    }
    drawCharts();
  });

  document.getElementById("run-id").textContent = run;
  document.title = `ampscope: ${run}`;
  // For tests and the curious: what is drawn, reachable from the console.
  window.ampscopeRun = {
    get series() { return series; },
    get scalePlot() { return scalePlot; },
    get skipsPlot() { return skipsPlot; },
    get lossPlot() { return lossPlot; },
    get normPlot() { return normPlot; },
    heatmaps,
    rankColor,
  };
  a.every(REFRESH_MS, refresh);
})();
