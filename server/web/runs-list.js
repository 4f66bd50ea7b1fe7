// The runs list: name, hosts, state, attempt, progress, ETA, TTT depth and last loss (TTT step 0's, loss_0, as the
// run page charts it: the same quantity at every depth, where the summed `loss` grows with it); filtered by state.

import { api } from "./api.js";
import { comparableLoss, duration, el, number, progressBar, replace, statusBadge, tttDepth } from "./dom.js";
import { RUN_STATES } from "./names.js";

const REFRESH_MS = 3000;

function row(run) {
  return el("tr", { "data-run-id": run.id },
    el("td", {}, el("a", { href: `#/runs/${encodeURIComponent(run.id)}` }, run.name),
      el("div", { class: "muted small" }, run.id)),
    el("td", {}, run.hosts.join(", ")),
    el("td", {}, statusBadge(run.status), run.host_reachable ? null : el("span", { class: "warn" }, " unreachable")),
    el("td", { class: "num" }, run.attempt),
    el("td", {}, progressBar(run.progress)),
    el("td", { class: "num" }, duration(run.eta_seconds)),
    el("td", { class: "num" }, tttDepth(run) ?? "—"),
    el("td", { class: "num", "data-loss": "" }, number(comparableLoss(run.latest))));
}

export function showRunsList(root, params, signal) {
  const state = params.get("state") || "";
  const filter = el("select", {
    id: "state-filter",
    onchange: (e) => { location.hash = e.target.value ? `#/?state=${e.target.value}` : "#/"; },
  }, el("option", { value: "" }, "all states"), RUN_STATES.map((s) => el("option", { value: s, selected: s === state }, s)));
  const body = el("tbody");
  const status = el("p", { class: "muted small" });
  replace(root,
    el("div", { class: "toolbar" }, el("h1", {}, "Runs"), el("label", {}, "State ", filter)),
    el("table", { class: "runs", id: "runs" },
      el("thead", {}, el("tr", {}, ["Name", "Host", "State", "Attempt", "Progress", "ETA", "TTT", "Last loss (TTT step 0)"]
        .map((h) => el("th", {}, h)))),
      body),
    status);

  async function refresh() {
    try {
      const page = await api("/v1/runs", { params: { status: state || null, limit: 200 } });
      replace(body, page.items.length ? page.items.map(row)
        : el("tr", {}, el("td", { colspan: 8, class: "empty" }, state ? `no ${state} runs` : "no runs yet")));
      replace(status, `updated ${new Date().toLocaleTimeString()}`, page.next_cursor ? " · newest 200 shown" : "");
    } catch (error) {
      replace(status, el("span", { class: "error" }, error.message));
    }
  }
  refresh();
  const timer = setInterval(refresh, REFRESH_MS);
  signal.addEventListener("abort", () => clearInterval(timer));
}
