// Shared by the pages: fetching the exporter's JSON API and formatting its values.
// Everything a page shows is built with textContent (parameter names are user data).
"use strict";

const ampscope = {
  /** GET a path of the exporter's API (relative, so a reverse-proxy prefix keeps working). */
  async getJSON(path) {
    const response = await fetch(path, { headers: { Accept: "application/json" } });
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
      const error = new Error(`${response.status}: ${detail}`);
      error.status = response.status;
      throw error;
    }
    return response.json();
  },

  runPath(run) { return `api/v1/runs/${encodeURIComponent(run)}`; },

  /** A loss scale as 2^k when it is a power of two (they nearly always are). */
  scaleText(scale) {
    if (scale === null || scale === undefined) return "-";
    if (scale > 0 && Number.isFinite(scale)) {
      const exponent = Math.log2(scale);
      if (Number.isInteger(exponent)) return `2^${exponent}`;
    }
    return String(Number(scale.toPrecision(4)));
  },

  /** What a rank runs; exporters that predate `setup` serve only scalers. */
  setup(rank) { return rank.setup || { mode: "scaler", policy: "skip", grad_dtype: null }; },

  /** Whether a rank runs a watch (bf16/fp32: no loss scale) rather than a scaler. */
  isWatch(rank) { return ampscope.setup(rank).mode === "watch"; },

  /** "scaler", or "watch/observe": a watch's policy decides what a bad step does. */
  modeText(rank) {
    const setup = ampscope.setup(rank);
    return setup.mode === "watch" ? `watch/${setup.policy}` : "scaler";
  },

  /** A run's setup in words: "no loss scale: bfloat16 watch, policy observe". */
  setupText(ranks) {
    const described = [];
    for (const rank of ranks) {
      const setup = ampscope.setup(rank);
      const dtype = setup.grad_dtype || "unknown dtype";
      // A scaler's gradients are often float32 (autocast keeps fp32 parameters), so the dtype
      // describes the gradients, never the scaler.
      const text = setup.mode === "watch"
        ? `no loss scale: ${dtype} watch, policy ${setup.policy}`
        : setup.grad_dtype ? `loss scaler, ${dtype} gradients` : "loss scaler";
      if (!described.includes(text)) described.push(text);
    }
    return described.join("; ");
  },

  /** The range of the scalers' scales, or "none" when every rank runs a watch. */
  scalesText(ranks) {
    const scales = ranks.filter((r) => !ampscope.isWatch(r)).map((r) => r.scale);
    if (!scales.length) return "none";
    const low = Math.min(...scales), high = Math.max(...scales);
    return low === high ? ampscope.scaleText(low) : `${ampscope.scaleText(low)}..${ampscope.scaleText(high)}`;
  },

  /** A rank's lifecycle state as the API gives it; older exporters only say up or not. */
  rankState(rank) {
    if (typeof rank.state === "string" && rank.state) return rank.state;
    return rank.up ? "up" : "stale";
  },

  /** A live rank that says it paused on purpose: "paused (checkpoint) for 700 s", and for a
   * stalled one (past the exporter's --pause-limit) ", past the pause limit"; "" otherwise. */
  pauseText(rank) {
    const pause = rank.pause;
    if (!pause || typeof pause.reason !== "string") return "";
    const text = `paused (${pause.reason}) for ${Math.round(pause.seconds)} s`;
    return rank.state === "stalled" ? `${text}, past the pause limit` : text;
  },

  /** What a failed rank's training ended on, in words: "NonFiniteGradientsError at step 5"
   *  (a GradWatch's stop), "RuntimeError after step 7" (any other exception); "" otherwise. */
  failureText(rank) {
    const failure = rank.failure;
    if (ampscope.rankState(rank) !== "failed" || !failure) return "";
    const when = failure.kind === "nonfinite_gradients" ? "at" : "after";
    return `${failure.exception} ${when} step ${failure.step}`;
  },

  /** Which signal stopped a stopped rank, in words: "stopped by SIGTERM (signal 15)"; ""
   *  otherwise. */
  stopText(rank) {
    if (ampscope.rankState(rank) !== "stopped" || !rank.stop_signal) return "";
    // SIGTERM is the one launchers send (torchrun, Slurm, Kubernetes); others by number.
    if (rank.stop_signal === 15) return "stopped by SIGTERM (signal 15)";
    return `stopped by signal ${rank.stop_signal}`;
  },

  /** "2 running, 1 lost" from a run's ranks. */
  statesText(ranks) {
    const counts = new Map();
    for (const rank of ranks) {
      const state = ampscope.rankState(rank);
      counts.set(state, (counts.get(state) || 0) + 1);
    }
    return [...counts].map(([state, n]) => `${n} ${state}`).join(", ");
  },

  sum(values) { return values.reduce((a, b) => a + b, 0); },

  /** Create an element with optional class and text. */
  el(tag, { cls, text, title } = {}) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = String(text);
    if (title) node.title = title;
    return node;
  },

  cell(row, text, cls) { return row.appendChild(ampscope.el("td", { cls, text })); },

  badge(status) { return ampscope.el("span", { cls: `badge ${status}`, text: status }); },

  /** Mark the page as refreshed now, or show why the last refresh failed. */
  updated(error) {
    const node = document.getElementById("updated");
    node.textContent = error
      ? `refresh failed: ${error.message}`
      : `updated ${new Date().toLocaleTimeString()}`;
  },

  /** Call refresh() now and every periodMs, never two at once. */
  every(periodMs, refresh) {
    const tick = async () => {
      try {
        await refresh();
        ampscope.updated(null);
      } catch (error) {
        ampscope.updated(error);
      }
      setTimeout(tick, periodMs);
    };
    tick();
  },
};
