// The runs page: GET /api/v1/runs, then each run's /ranks and /health, every 5 s.
"use strict";

(() => {
  const REFRESH_MS = 5000;
  const a = ampscope;

  function row(summary, ranks, health) {
    const tr = a.el("tr");
    tr.dataset.run = summary.run;
    const link = a.el("a", { text: summary.run });
    link.href = `run?id=${encodeURIComponent(summary.run)}`;
    tr.appendChild(a.el("td")).appendChild(link);
    tr.appendChild(a.el("td", { cls: "health" })).appendChild(a.badge(health.status));
    a.cell(tr, `${summary.up}/${summary.ranks} up (world ${summary.world_size})`, "ranks");
    a.cell(tr, a.statesText(ranks), "states");
    a.cell(tr, summary.newest_step, "num step");
    a.cell(tr, a.scalesText(ranks), "num scale").title = a.setupText(ranks);
    const skipped = Math.max(...ranks.map((r) => r.totals.skipped_steps));
    a.cell(tr, skipped, "num skipped");
    const local = a.sum(ranks.map((r) => a.sum(Object.values(r.totals.found_inf_local))));
    const origin = a.sum(ranks.map((r) => a.sum(Object.values(r.totals.found_inf_origin))));
    a.cell(tr, `${local} / ${origin}`, "num found-inf");
    const flagged = health.verdicts.filter((v) => v.status !== "ok");
    const td = a.cell(tr, flagged.length ? "" : "-", "flagged");
    for (const verdict of flagged) {
      td.append(a.el("span", { cls: `state ${verdict.status}`, text: verdict.rule, title: verdict.summary }), " ");
    }
    return tr;
  }

  async function refresh() {
    const summaries = await a.getJSON("api/v1/runs");
    const details = await Promise.all(
      summaries.map((s) =>
        Promise.all([a.getJSON(`${a.runPath(s.run)}/ranks`), a.getJSON(`${a.runPath(s.run)}/health`)])
          // A run retention dropped between the two requests is simply left out.
          .catch((error) => { if (error.status === 404) return null; throw error; })
      )
    );
    const table = document.getElementById("runs");
    const body = table.querySelector("tbody");
    const rows = [];
    summaries.forEach((summary, i) => { if (details[i]) rows.push(row(summary, ...details[i])); });
    body.replaceChildren(...rows);
    table.hidden = rows.length === 0;
    document.getElementById("message").textContent = rows.length
      ? `${rows.length} run(s); refreshes every ${REFRESH_MS / 1000} s`
      : "No run has reported yet. Ranks report here when their GradScaler (or, for bf16/fp32, " +
        "GradWatch) is an ampscope one " +
        "(AMPSCOPE_URL points at this exporter); try `ampscope demo`.";
  }

  a.every(REFRESH_MS, refresh);
})();
