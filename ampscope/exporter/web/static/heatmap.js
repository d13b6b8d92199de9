// A rank/device x step heatmap on a plain canvas: 64 ranks x 1024 steps is 65k cells, too
// many for SVG elements, and uPlot draws lines, not grids. Only lit cells are painted.
"use strict";

class Heatmap {
  /**
   * @param {HTMLCanvasElement} canvas
   * @param {string} color  fill of a cell whose rank/device saw inf/NaN at that step
   */
  constructor(canvas, color) {
    this.canvas = canvas;
    this.color = color;
    this.rows = [];
    this.layout = null;
  }

  /**
   * Draw rows (each {label, steps: number[]}) against an x axis shared with the charts.
   * @param {object} layout  {total: css width, left, width: of the plot area, xpos(step) -> css px from the canvas' left,
   *                          steps: ascending steps drawn}
   */
  draw(rows, layout) {
    this.rows = rows;
    const rowHeight = Math.max(1, Math.min(14, Math.floor(320 / Math.max(rows.length, 1))));
    const height = rows.length * rowHeight;
    const steps = layout.steps;
    const span = steps.length > 1 ? steps[steps.length - 1] - steps[0] : 1;
    const cellWidth = Math.max(1, layout.width / (span + 1));
    this.layout = { ...layout, rowHeight, cellWidth, height };
    const ratio = window.devicePixelRatio || 1;
    const cssWidth = layout.total;
    this.canvas.style.width = `${cssWidth}px`;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(cssWidth * ratio);
    this.canvas.height = Math.max(1, Math.round(height * ratio));
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, cssWidth, height);
    // Cells go into one pixel buffer: 64 ranks x 8 devices with an overflow every few steps
    // is ~10^5 cells, which fillRect draws in ~300 ms and a typed array in a few.
    const width = Math.max(1, Math.round(layout.width * ratio));
    const image = ctx.createImageData(width, this.canvas.height);
    const pixels = new Uint32Array(image.data.buffer);
    pixels.fill(Heatmap.pixel("#f1f3f4"));
    const lit = Heatmap.pixel(this.color);
    const boundary = Heatmap.pixel("#ffffff");
    const gap = rowHeight > 4 ? 1 : 0;
    let previousRank = null;
    rows.forEach((row, index) => {
      const y0 = Math.round(index * rowHeight * ratio);
      const y1 = Math.min(this.canvas.height, Math.round(((index + 1) * rowHeight - gap) * ratio));
      if (previousRank !== null && row.rank !== previousRank && rowHeight > 2) {
        pixels.fill(boundary, y0 * width, (y0 + 1) * width); // a rank boundary between devices
      }
      previousRank = row.rank;
      for (const step of row.steps) {
        const x = layout.xpos(step);
        if (x === null) continue;
        const x0 = Math.max(0, Math.round((x - layout.left - cellWidth / 2) * ratio));
        const x1 = Math.min(width, Math.max(x0 + 1, Math.round((x - layout.left + cellWidth / 2) * ratio)));
        for (let y = y0; y < y1; y++) pixels.fill(lit, y * width + x0, y * width + x1);
      }
    });
    ctx.putImageData(image, Math.round(layout.left * ratio), 0);
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    ctx.fillStyle = "#444";
    if (rowHeight >= 8) {
      ctx.font = `${Math.min(11, rowHeight)}px system-ui, sans-serif`;
      rows.forEach((row, index) => ctx.fillText(row.label, layout.left - 4, (index + 0.5) * rowHeight));
    } else {
      // Rows too thin for a label each: name each rank's group of device rows, where it fits.
      ctx.font = "10px system-ui, sans-serif";
      let lastLabel = -Infinity;
      rows.forEach((row, index) => {
        const top = index * rowHeight;
        if ((index === 0 || rows[index - 1].rank !== row.rank) && top - lastLabel >= 11) {
          ctx.fillText(`rank ${row.rank}`, layout.left - 4, top + 5);
          lastLabel = top;
        }
      });
    }
  }

  /** A "#rrggbb" colour as one opaque RGBA pixel of a Uint32Array view (little-endian). */
  static pixel(hex) {
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
    return ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
  }

  /** Centre of a cell in CSS pixels from the canvas' top-left, or null off the chart. */
  cellCenter(rowIndex, step) {
    const layout = this.layout;
    if (!layout || rowIndex < 0 || rowIndex >= this.rows.length) return null;
    const x = layout.xpos(step);
    if (x === null) return null;
    return { x, y: rowIndex * layout.rowHeight + layout.rowHeight / 2 };
  }

  /** The row and nearest drawn step under a point (CSS px from the canvas' top-left). */
  hit(x, y) {
    const layout = this.layout;
    if (!layout || x < layout.left || x > layout.left + layout.width) return null;
    const rowIndex = Math.floor(y / layout.rowHeight);
    if (rowIndex < 0 || rowIndex >= this.rows.length || !layout.steps.length) return null;
    let best = null;
    let bestDistance = Infinity;
    for (const step of layout.steps) {
      const distance = Math.abs(layout.xpos(step) - x);
      if (distance < bestDistance) { best = step; bestDistance = distance; }
    }
    const row = this.rows[rowIndex];
    return { row, step: best, hit: row.steps.includes(best) };
  }
}
