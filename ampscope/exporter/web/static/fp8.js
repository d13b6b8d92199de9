// The run page's FP8 layer table: one rank's torchao Float8Linear layers, a row per layer and
// cast tensor, from /ranks (each rank's `fp8` series) and /health (the FP8 verdicts mark the
// series they flag). One rank at a time: a job of many ranks and layers would otherwise draw
// thousands of rows every refresh. The rank shown is the one chosen, else the first rank a
// verdict flags, else the lowest.
"use strict";

const ampscopeFp8 = (() => {
  const a = ampscope;
  const RULES = ["fp8_nonfinite_amax", "fp8_amax_spike", "fp8_underflow"];
  let chosen = null; // the rank the reader picked, kept across refreshes

  const key = (rank, layer, tensor) => `${rank}|${layer}|${tensor}`;

  /** key -> {rule: evidence entry} of every series a flagged FP8 verdict names. */
  function flaggedSeries(health) {
    const flagged = new Map();
    for (const verdict of health.verdicts) {
      if (!RULES.includes(verdict.rule) || verdict.status === "ok") continue;
      for (const entry of verdict.evidence.series || []) {
        const k = key(entry.rank, entry.layer, entry.tensor);
        if (!flagged.has(k)) flagged.set(k, {});
        flagged.get(k)[verdict.rule] = entry;
      }
    }
    return flagged;
  }

  const number = (value) => (value === null || value === undefined ? "-" : String(Number(value.toPrecision(4))));

  /** The scale a cast multiplied by: tensorwise one number, rowwise the range of its rows. */
  function scaleText(entry) {
    if (!entry.rowwise || entry.scale_min === entry.scale) return number(entry.scale);
    return `${number(entry.scale_min)}..${number(entry.scale)}`;
  }

  function row(series, marks) {
    const tr = a.el("tr");
    tr.dataset.layer = series.layer;
    tr.dataset.tensor = series.tensor;
    const entry = series.newest;
    a.cell(tr, series.layer);
    a.cell(tr, series.tensor);
    a.cell(tr, `${entry.dtype}${entry.rowwise ? " rowwise" : ""}`).title = `cast: ${entry.cast}`;
    const amax = a.cell(tr, entry.amax === null ? "inf/NaN" : number(entry.amax), "num amax");
    a.cell(tr, number(series.baseline), "num");
    a.cell(tr, scaleText(entry), "num scale");
    const underflow = a.cell(tr, `${(entry.underflow_ratio * 100).toFixed(1)} %`, "num underflow");
    a.cell(tr, series.skipped ? `${series.step} (skipped)` : series.step, "num");
    const notes = [];
    const spike = marks.fp8_amax_spike;
    if (spike) {
      amax.classList.add("bad");
      tr.classList.add("spike");
      notes.push(`spike at step ${spike.step}: ${Math.round(spike.factor)}x its median`);
    } else if (series.spike) {
      notes.push(`last spike at step ${series.spike.step}`);
    }
    if (marks.fp8_nonfinite_amax) {
      amax.classList.add("bad");
      notes.push(`inf/NaN amax at step ${marks.fp8_nonfinite_amax.step}`);
    }
    if (marks.fp8_underflow) {
      underflow.classList.add("bad");
      notes.push("underflow above the threshold in each recent observation");
    }
    a.cell(tr, notes.join("; "), "flag");
    return tr;
  }

  /** Draw (or hide) the FP8 section from one refresh's ranks and health. */
  function draw(ranks, health) {
    const section = document.getElementById("fp8-section");
    const holding = ranks.filter((r) => r.fp8 && r.fp8.length).sort((x, y) => x.rank - y.rank);
    section.hidden = holding.length === 0;
    if (section.hidden) return;
    const flagged = flaggedSeries(health);
    const numbers = holding.map((r) => r.rank);
    const firstFlagged = holding.find((r) => r.fp8.some((s) => flagged.has(key(r.rank, s.layer, s.tensor))));
    const shown = numbers.includes(chosen) ? chosen : (firstFlagged || holding[0]).rank;

    const select = document.getElementById("fp8-rank");
    if (select.dataset.ranks !== numbers.join()) {
      select.replaceChildren(...numbers.map((n) => {
        const option = a.el("option", { text: `rank ${n}` });
        option.value = String(n);
        return option;
      }));
      select.dataset.ranks = numbers.join();
    }
    select.value = String(shown);
    for (const option of select.options) {
      const n = Number(option.value);
      const marked = holding.find((r) => r.rank === n).fp8.some((s) => flagged.has(key(n, s.layer, s.tensor)));
      option.textContent = `rank ${n}${marked ? " (flagged)" : ""}`;
    }

    const rank = holding.find((r) => r.rank === shown);
    document.getElementById("fp8-node").textContent = `node ${rank.node}, ${rank.fp8.length} series`;
    const rows = rank.fp8.map((series) => row(series, flagged.get(key(shown, series.layer, series.tensor)) || {}));
    document.querySelector("#fp8 tbody").replaceChildren(...rows);
  }

  document.getElementById("fp8-rank").addEventListener("change", (event) => {
    chosen = Number(event.target.value);
    if (ampscopeFp8.last) draw(...ampscopeFp8.last);
  });

  return {
    draw(ranks, health) {
      ampscopeFp8.last = [ranks, health];
      draw(ranks, health);
    },
    last: null,
  };
})();
