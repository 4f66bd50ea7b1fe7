// Line charts on uPlot (vendored): one line per (series, attempt), the attempts' starts marked.

import uPlot from "./vendor/uplot/uPlot.esm.js";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#db2777", "#65a30d",
  "#4f46e5", "#b45309", "#0d9488", "#7c3aed"];
const DASHES = [[], [8, 4], [2, 3], [12, 3, 2, 3]];

export const color = (index) => PALETTE[index % PALETTE.length];

// lines: [{name, attempt, points: [[x, y], ...]}]; one name per chart colours by attempt, several by name
function seriesStyle(lines) {
  const names = [...new Set(lines.map((l) => l.name))];
  const attempts = [...new Set(lines.map((l) => l.attempt))].sort((a, b) => a - b);
  return lines.map((line) => {
    const attemptIndex = attempts.indexOf(line.attempt);
    const byAttempt = names.length === 1;
    return {
      label: line.attempt === null ? line.name : `${line.name} · attempt ${line.attempt}`,
      stroke: color(byAttempt ? attemptIndex : names.indexOf(line.name)),
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
        ctx.textAlign = "left";
        ctx.textBaseline = "top";
        for (const marker of chart.markers) {
          const x = Math.round(u.valToPos(marker.x, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.beginPath();
          ctx.moveTo(x, top);
          ctx.lineTo(x, top + height);
          ctx.stroke();
          ctx.fillText(marker.label, x + 4, top + 2 * devicePixelRatio);
        }
        ctx.restore();
      }],
    },
  };
}

export class LineChart {
  constructor(container, { title, xLabel = "step", xIsTime = false, yLabel = "" }) {
    this.container = container;
    this.title = title;
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
    this.container.dataset.points = String(drawn.reduce((n, l) => n + l.points.length, 0));
    const signature = drawn.map((l) => `${l.name}|${l.attempt}`).join(",");
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
      series: [{ label: this.xLabel }, ...seriesStyle(drawn)],
      plugins: [markerPlugin(this)],
      legend: { live: true },
    }, data, this.container);
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
