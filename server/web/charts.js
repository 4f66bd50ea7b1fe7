// Line charts on uPlot (vendored): one line per (series, attempt), the attempts' starts marked.

import uPlot from "./vendor/uplot/uPlot.esm.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#db2777", "#65a30d",
  "#4f46e5", "#b45309", "#0d9488", "#7c3aed"];
const DASHES = [[], [8, 4], [2, 3], [12, 3, 2, 3]];

export const color = (index) => PALETTE[index % PALETTE.length];

// a group's k-th of n lines (acc_0 ... acc_15): from dark to light blue, so that the family reads as one
const shade = (k, n) => `hsl(217, 80%, ${Math.round(25 + (50 * k) / Math.max(1, n - 1))}%)`;

const label = (line) => (line.attempt === null ? line.name : `${line.name} · attempt ${line.attempt}`);

// lines: [{name, attempt, points: [[x, y], ...]}]; one name per chart colours by attempt, several by name, a
// group (indexed names) by shade of one colour
function seriesStyle(lines, group) {
  const names = [...new Set(lines.map((l) => l.name))];
  const attempts = [...new Set(lines.map((l) => l.attempt))].sort((a, b) => a - b);
  return lines.map((line) => {
    const attemptIndex = attempts.indexOf(line.attempt);
    const byAttempt = names.length === 1;
    const nameIndex = names.indexOf(line.name);
    return {
      label: label(line),
      stroke: group ? shade(nameIndex, names.length) : color(byAttempt ? attemptIndex : nameIndex),
      dash: byAttempt ? [] : DASHES[attemptIndex % DASHES.length],
      width: 1.5,
      spanGaps: true,
      points: { show: false },
    };
  });
}

function aligned(lines) {
  const xs = [...new Set(lines.flatMap((l) => l.points.map((p) => p[0])))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const columns = lines.map((line) => {
    const ys = new Array(xs.length).fill(null);
    for (const [x, y] of line.points) ys[index.get(x)] = y;
    return ys;
  });
  return [xs, ...columns];
}

function markerPlugin(chart) {
  return {
    hooks: {
      draw: [(u) => {
        const { ctx } = u;
        const { top, height } = u.bbox;
        ctx.save();
        ctx.strokeStyle = "#64748b";
        ctx.fillStyle = "#334155";
        ctx.setLineDash([4, 4]);
        ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
        ctx.textBaseline = "top";
        const right = u.bbox.left + u.bbox.width, pad = 4 * devicePixelRatio, row = 14 * devicePixelRatio;
        chart.markers.forEach((marker, i) => {
          const x = Math.round(u.valToPos(marker.x, "x", true));
          if (x < u.bbox.left || x > right) return;
          ctx.beginPath();
          ctx.moveTo(x, top);
          ctx.lineTo(x, top + height);
          ctx.stroke();
          // the label on the line's right, or on its left where it would run past the plot; one row per marker,
          // so that fresh attempts all marked at step 0 do not write over each other
          const width = ctx.measureText(marker.label).width;
          const fits = x + pad + width <= right;
          ctx.textAlign = fits ? "left" : "right";
          ctx.fillText(marker.label, fits ? x + pad : Math.max(x - pad, u.bbox.left + width), top + 2 * devicePixelRatio + i * row);
        });
        ctx.restore();
      }],
    },
  };
}

// one legend row per attempt for a group: its shades and "acc_0 … acc_4 · attempt 2" (uPlot's would list each line)
function compactLegend(lines) {
  const rows = new Map();
  for (const line of lines) {
    if (!rows.has(line.attempt)) rows.set(line.attempt, []);
    rows.get(line.attempt).push(line.name);
  }
  const legend = document.createElement("div");
  legend.className = "u-legend compact-legend small";
  for (const [attempt, names] of rows) {
    const row = document.createElement("div");
    names.forEach((_, k) => {
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = shade(k, names.length);
      row.append(swatch);
    });
    const text = names.length > 1 ? `${names[0]} … ${names.at(-1)}` : names[0];
    row.append(` ${label({ name: text, attempt })}`);
    legend.append(row);
  }
  return legend;
}

export class LineChart {
  constructor(container, { title, xLabel = "step", xIsTime = false, yLabel = "", group = false }) {
    this.container = container;
    this.title = title;
    this.group = group;
    this.xLabel = xLabel;
    this.xIsTime = xIsTime;
    this.yLabel = yLabel;
    this.markers = [];
    this.plot = null;
    this.signature = "";
  }

  get width() {
    return Math.max(280, this.container.clientWidth - 8);
  }

  update(lines, markers = []) {
    const drawn = lines.filter((l) => l.points.length);
    this.markers = markers;
    this.container.dataset.markers = JSON.stringify(markers);
    this.container.dataset.points = String(drawn.reduce((n, l) => n + l.points.length, 0));
    const signature = this.title + "|" + drawn.map((l) => `${l.name}|${l.attempt}`).join(",");
    if (!drawn.length) {
      this.destroy();
      this.container.replaceChildren(Object.assign(document.createElement("p"), {
        className: "empty", textContent: `${this.title}: no points yet`,
      }));
      return;
    }
    const data = aligned(drawn);
    if (this.plot && signature === this.signature) {
      this.plot.setData(data);
      return;
    }
    this.destroy();
    this.container.replaceChildren();
    this.signature = signature;
    this.plot = new uPlot({
      title: this.title,
      width: this.width,
      height: 220,
      scales: { x: { time: this.xIsTime } },
      axes: [{ label: this.xLabel }, { label: this.yLabel, size: 60 }],
      series: [{ label: this.xLabel }, ...seriesStyle(drawn, this.group)],
      plugins: [markerPlugin(this)],
      legend: { show: !this.group, live: true },
    }, data, this.container);
    if (this.group) this.container.append(compactLegend(drawn));
  }

  resize() {
    if (this.plot) this.plot.setSize({ width: this.width, height: 220 });
  }

  destroy() {
    if (this.plot) this.plot.destroy();
    this.plot = null;
    this.signature = "";
  }
}
