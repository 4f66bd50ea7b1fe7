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

// Every string goes in isolated, in a <bdi> (dir=auto, unicode-bidi: isolate): a name or message holding a bidi
// override (U+202E) or right-to-left text cannot reorder the text around it (Trojan Source, CVE-2021-42574). Where
// an element takes text only (an option, a textarea), the text goes in as it is.
const TEXT_ONLY = new Set(["OPTION", "TEXTAREA", "TITLE"]);

export function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    if (child instanceof Node) node.append(child);
    else if (TEXT_ONLY.has(node.tagName)) node.append(document.createTextNode(String(child)));
    else node.append(Object.assign(document.createElement("bdi"), { textContent: String(child) }));
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

// a job's log line with its bidi controls shown (`<U+202E>`), as the command shows them (longrun/safe_text.py): in
// the log's one text, an override would reorder the rest of its line
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
export const visibleControls = (line) => line.replace(BIDI_CONTROLS, (c) => `<U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}>`);
