// A stacked bar chart in SVG: one bar per x label, one colour per series. No library needed.

const NS = "http://www.w3.org/2000/svg";
const COLOURS = ["#2563eb", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#0ea5e9", "#84cc16", "#ec4899"];
const WIDTH = 900;
const HEIGHT = 260;
const PAD = { left: 64, right: 12, top: 12, bottom: 40 };

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, value);
  if (text !== undefined) el.textContent = text;
  return el;
}

const short = (n) =>
  Math.abs(n) >= 1e6 ? `${+(n / 1e6).toFixed(2)}M` : Math.abs(n) >= 1e3 ? `${+(n / 1e3).toFixed(1)}k` : `${+n.toFixed(4)}`;

/**
 * ``labels``: the x values in order; ``series``: [{name, values}] with one value per label.
 * Returns a <figure> with the chart and its legend.
 */
export function barChart({ title, labels, series }) {
  const totals = labels.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
  const max = Math.max(...totals, 0) || 1;
  const plotW = WIDTH - PAD.left - PAD.right;
  const plotH = HEIGHT - PAD.top - PAD.bottom;
  const band = plotW / Math.max(labels.length, 1);
  const barW = Math.max(2, Math.min(48, band * 0.7));
  const y = (v) => PAD.top + plotH - (v / max) * plotH;

  const root = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", "aria-label": title, class: "chart" });
  root.append(svg("title", {}, title));
  for (const tick of [0, 0.25, 0.5, 0.75, 1]) {
    const value = max * tick;
    root.append(
      svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(value), y2: y(value), class: "grid" }),
      svg("text", { x: PAD.left - 6, y: y(value) + 4, "text-anchor": "end", class: "axis" }, short(value)),
    );
  }
  const every = Math.ceil(labels.length / 12);
  labels.forEach((label, i) => {
    const x = PAD.left + band * i + (band - barW) / 2;
    let base = 0;
    series.forEach((s, k) => {
      const v = s.values[i] || 0;
      if (v > 0) {
        const rect = svg("rect", { x, y: y(base + v), width: barW, height: y(base) - y(base + v), fill: COLOURS[k % COLOURS.length] });
        rect.append(svg("title", {}, `${label} · ${s.name}: ${v}`));
        root.append(rect);
      }
      base += v;
    });
    if (i % every === 0) {
      root.append(svg("text", { x: x + barW / 2, y: HEIGHT - PAD.bottom + 16, "text-anchor": "middle", class: "axis" }, label));
    }
  });

  const legend = document.createElement("ul");
  legend.className = "legend";
  series.forEach((s, k) => {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = COLOURS[k % COLOURS.length];
    item.append(swatch, s.name);
    legend.append(item);
  });
  const figure = document.createElement("figure");
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  figure.append(caption, root, legend);
  return figure;
}
