// DOM building with text nodes only: data from the server never goes through innerHTML.

import { NOT_FINITE } from "./names.js";

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node && typeof value !== "string") node[key] = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function replace(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

export function number(value, digits = 4) {
  if (NOT_FINITE.has(value)) return value;  // the server's marker of a non-finite value, shown as it is
  if (value === null || value === undefined || !Number.isFinite(value)) return "—";
  return Math.abs(value) >= 1000 ? Math.round(value).toLocaleString("en") : Number(value.toPrecision(digits)).toString();
}

export const percent = (ratio) => (ratio === null || ratio === undefined ? "—" : `${(ratio * 100).toFixed(1)}%`);

export const when = (iso) => (iso ? new Date(iso).toLocaleString() : "—");

export function progressBar(ratio) {
  const bar = el("span", { class: "bar" }, el("span", { class: "fill" }));
  bar.firstChild.style.width = `${Math.round((ratio || 0) * 100)}%`;
  return el("span", { class: "progress" }, bar, " ", percent(ratio));
}

export const statusBadge = (status) => el("span", { class: `badge status-${status}` }, status);

// TTT step 0's loss (loss_0), comparable across depths; `loss` for a trainer that logs no per-step losses
export const comparableLoss = (latest) => latest?.loss_0 ?? latest?.loss;

export const tttDepth = (run) => run.spec?.trainer?.ttt_steps ?? run.latest?.ttt_steps ?? null;
