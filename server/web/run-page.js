// One run: summary, live charts, actions (cancel, restart with a dry run first), attempts, evaluation, log tail.

import { api, followEvents, runPath } from "./api.js";
import { LineChart } from "./charts.js";
import { comparableLoss, duration, el, number, percent, progressBar, replace, statusBadge, tttDepth, visibleControls, when } from "./dom.js";
import { GPU_MEM_SERIES, GPU_UTIL_SERIES, NOT_FINITE, TERMINAL, TRAINER_SERIES as S, indexed, indexedPattern } from "./names.js";

const LOG_POLL_MS = 2000;
const RUN_POLL_MS = 5000;
// the log is kept as one text node per read; older reads fall off past this many
const LOG_KEEP_READS = 500;
const byNumberInName = (a, b) => a.localeCompare(b, "en", { numeric: true });
const VAL_LOSS = S.val + S.loss;
const ACC_K = indexedPattern(S.acc);
const SIM_ACC_K = indexedPattern(S.sim_acc);

// loss_0 (step 0's loss) is the same quantity at every TTT depth, where `loss` sums Σ w^k·loss_k over the steps
// and so grows with the depth: a restart at TTT=5 would look like a regression. Runs without it (your own
// trainer) chart `loss`.
const CHARTS = [
  { id: "loss", title: "Loss of TTT step 0 (loss_0: comparable across depths)", y: "loss",
    match: (n) => n === indexed(S.loss, 0) || n === indexed(VAL_LOSS, 0),
    fallback: { title: "Loss", match: (n) => n === S.loss || n === VAL_LOSS },
    smooth: true },
  { id: "acc", title: "Accuracy by TTT step (acc_k)", y: "accuracy", match: (n) => ACC_K.test(n), group: true, smooth: true },
  { id: "throughput", title: "Tokens/s", y: "tokens/s", match: (n) => n === S.tokens_per_s },
  { id: "gpu-util", title: "GPU utilisation", y: "%", match: (n) => GPU_UTIL_SERIES.test(n), gpu: true },
  { id: "gpu-mem", title: "GPU memory", y: "MiB", match: (n) => GPU_MEM_SERIES.test(n), gpu: true },
];

// TensorBoard's smoothing: an exponential moving average, debiased at the start of each line
function smoothed(points, weight) {
  if (!weight) return points;
  let last = 0, count = 0;
  return points.map(([x, y]) => {
    if (y === null || !Number.isFinite(y)) return [x, y];
    last = last * weight + (1 - weight) * y;
    count += 1;
    return [x, last / (1 - weight ** count)];
  });
}

// one call at a time; calls made meanwhile fold into one more after it
function coalesced(task) {
  let running = null, again = false;
  const call = async () => {
    if (running) { again = true; return running; }
    running = (async () => {
      do { again = false; await task(); } while (again);
    })().finally(() => { running = null; });
    return running;
  };
  return call;
}

function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    for (const [key, inner] of Object.entries(value)) flatten(inner, prefix ? `${prefix}.${key}` : key, out);
  } else if (prefix) {
    out[prefix] = JSON.stringify(value);
  }
  return out;
}

export function specChanges(before, after) {
  const a = flatten(before), b = flatten(after);
  return [...new Set([...Object.keys(a), ...Object.keys(b)])].sort()
    .filter((key) => a[key] !== b[key])
    .map((key) => `${key}: ${a[key] ?? "unset"} → ${b[key] ?? "unset"}`);
}

class MetricStore {
  constructor() {
    this.seen = new Set();
    this.byName = new Map();   // name -> Map(attempt -> [point])
    this.maxStep = new Map();  // attempt -> highest step seen
  }

  add(series) {
    let added = 0;
    for (const [name, points] of Object.entries(series)) {
      for (const p of points) {
        const key = `${name}|${p.attempt}|${p.step}|${p.time}`;
        if (this.seen.has(key)) continue;
        this.seen.add(key);
        if (!this.byName.has(name)) this.byName.set(name, new Map());
        const attempts = this.byName.get(name);
        if (!attempts.has(p.attempt)) attempts.set(p.attempt, []);
        attempts.get(p.attempt).push(p);
        if (p.step !== null) this.maxStep.set(p.attempt, Math.max(this.maxStep.get(p.attempt) ?? -1, p.step));
        added += 1;
      }
    }
    return added;
  }

  names(match) {
    return [...this.byName.keys()].filter(match).sort(byNumberInName);
  }

  // over steps each attempt is drawn at its own steps: one that resumed a checkpoint goes on from its predecessor's
  // step, one that started over (a fresh restart at another depth) is drawn from step 0 over the earlier ones, so
  // that the two compare step for step
  lines(names, xMode, smoothing = 0) {
    return names.flatMap((name) => [...this.byName.get(name)].sort((a, b) => a[0] - b[0]).map(([attempt, points]) => ({
      name, attempt,
      points: smoothed(points.filter((p) => xMode === "time" || p.step !== null)
        .map((p) => [xMode === "time" ? Date.parse(p.time) / 1000 : p.step, p.value]),
      name.startsWith(S.val) ? 0 : smoothing),
    })));
  }
}

function section(title, id, ...children) {
  return el("section", { id, class: "card" }, el("h2", {}, title), ...children);
}

// What each interconnect would serve at; whether to retrain is the proposal's one verdict (verdictLine), not
// each advice's own retrain.pays_off, which reads the acceptance as it is, without the proposal's evidence.
function advicePanel(advice) {
  return el("div", { class: "advice" },
    el("h3", {}, advice.interconnect === "pcie" ? "PCIe" : "NVLink", ` (TP ${advice.tp})`),
    el("dl", {},
      el("dt", {}, "Serve at depth"), el("dd", { class: "depth" }, advice.recommended_depth === 0 ? "0 (do not speculate)" : advice.recommended_depth),
      el("dt", {}, "Tokens/s"), el("dd", {}, number(advice.tokens_per_second), ` (${number(advice.speedup_vs_no_speculation, 3)}× no speculation)`)),
    el("p", { class: "muted small" }, advice.allreduce_basis));
}

const VERDICT = { restart: "restart", probe: "probe first", keep_going: "keep going", cannot_tell: "cannot tell yet", unavailable: "no proposal yet" };

// The run's verdict in one line, for the evaluation panel: the proposal's action and the evidence that decided.
function verdictText(p) {
  if (!p) return "Retrain: the run's proposal is loading…";
  const said = p.action === "restart" ? `restart at TTT=${p.suggested_ttt} (+${percent(p.gain)})` : VERDICT[p.action];
  const e = p.evidence;
  return `Retrain: ${said} (the run's proposal${e ? `, decided by ${e.source}` : ""}${
    e?.gain_interval ? `, gain ${signed(e.gain_interval[0])} to ${signed(e.gain_interval[1])} over its 90% intervals` : ""})`;
}

const signed = (x) => `${x < 0 ? "−" : "+"}${percent(Math.abs(x))}`;

function rates(values, bounds) {
  return values.map((a, i) => (bounds?.[i] ? `${number(a, 3)} [${number(bounds[i][0], 3)}, ${number(bounds[i][1], 3)}]` : number(a, 3))).join("  ");
}

// Which evidence decided: the simulation or decoding, over how many rounds, each rate with its 90% interval, the
// rate the retrain rule read its decay from, and for cannot tell what settles it.
function evidencePanel(e) {
  if (!e) return null;
  return el("dl", { class: "evidence", id: "proposal-evidence" },
    el("dt", {}, "Decided by"), el("dd", { id: "proposal-evidence-source" }, e.source === "decoding"
      ? `decoding (attempt ${e.attempt}'s evaluation${e.prompts ? `, ${e.prompts} prompts` : ""}) calibrating the simulation`
      : `simulation${e.rounds?.length ? ` (${e.rounds[0]} validation rounds)` : ""}, not yet checked against decoding`),
    el("dt", {}, "Acceptance"), el("dd", { class: "small" }, rates(e.acceptance, e.acceptance_interval)),
    e.step_acceptance?.length ? [el("dt", {}, "Step acceptance"), el("dd", { class: "small" }, rates(e.step_acceptance, e.step_acceptance_interval))] : null,
    el("dt", {}, "Interval"), el("dd", { id: "proposal-interval", class: "small" },
      (e.gain_interval ? `gain ${signed(e.gain_interval[0])} to ${signed(e.gain_interval[1])}; ` : "") + (e.interval || "none")),
    el("dt", {}, "Retrain rule"), el("dd", { id: "proposal-decay", class: "small" }, `reads ${e.decay_from}: ${e.decay_note}`),
    e.settle ? [el("dt", {}, "To settle"), el("dd", { id: "proposal-settle" }, e.settle)] : null);
}

// The probe that settles what the evidence cannot (server/advisor/probe.py): what it runs and costs, stated before
// it runs, and one button that takes it (POST /v1/runs/{id}/proposal/probe); under way or decided, what it says.
function probePanel(p, onProbe) {
  const probe = p.probe;
  if (!probe) return p.next_step ? el("p", { id: "proposal-next-step", class: "small" }, `Next step: ${p.next_step}`) : null;
  const cost = probe.predicted_seconds == null ? "its time unknown yet"
    : `${duration(probe.predicted_seconds)}, ${number(probe.gpu_hours, 3)} GPU-h`;
  return el("div", { id: "proposal-probe", class: `probe ${probe.status}` },
    el("dl", {},
      el("dt", {}, "Probe"), el("dd", { id: "proposal-probe-plan" },
        `TTT=${probe.ttt} for ${probe.steps} steps from the checkpoint at step ${probe.from_step} (${cost})`),
      el("dt", {}, "Decides"), el("dd", { class: "small" }, probe.decides),
      probe.decision ? [el("dt", {}, "Decided"), el("dd", { id: "proposal-probe-decision" }, probe.decision)] : null,
      p.next_step ? [el("dt", {}, "Next step"), el("dd", { id: "proposal-next-step", class: "small" }, p.next_step)] : null),
    probe.status === "offered" ? el("div", { class: "buttons" }, el("button", { id: "proposal-probe-take", type: "button",
      onclick: (event) => onProbe(event.target) }, `Probe TTT=${probe.ttt} for ${probe.steps} steps`)) : null);
}

// The service's depth proposal (GET /v1/runs/{id}/proposal): restart at a deeper TTT, with the economics, a probe
// first, or keep going; `onRestart` opens the restart form pre-filled with what it proposes, `onProbe` takes the probe.
function proposalPanel(p, onRestart, onProbe) {
  if (p.action === "unavailable") return el("div", {}, el("p", { class: "muted", id: "proposal-summary" }, p.summary),
    p.probe ? probePanel(p, onProbe) : null);
  const restart = p.action === "restart";
  return el("div", { class: `advice proposal ${p.action}` },
    el("p", { id: "proposal-verdict", class: "verdict" }, VERDICT[p.action]),
    el("p", { id: "proposal-summary" }, p.summary),
    el("dl", {},
      el("dt", {}, "Serve now"), el("dd", {}, `depth ${p.depth_now ?? "—"}: ${number(p.tokens_per_second_now)} tokens/s`),
      restart ? [
        el("dt", {}, "After restart"), el("dd", {}, `depth ${p.depth_after}: ${number(p.tokens_per_second_after)} tokens/s (+${percent(p.gain)})`),
        el("dt", {}, "Training"), el("dd", { id: "proposal-duration" }, duration(p.predicted_training_seconds)),
        el("dt", {}, "GPU-hours"), el("dd", {}, `${number(p.restart_gpu_hours, 3)} on ${p.gpus} GPUs (${number(p.extra_gpu_hours, 3)} more than finishing)`),
        el("dt", {}, "Won back after"), el("dd", {}, p.break_even_tokens ? `${number(p.break_even_tokens, 3)} tokens served` : "—"),
      ] : [el("dt", {}, "Why"), el("dd", {}, p.reason)],
      p.rule_record ? [el("dt", {}, "Rule's record"), el("dd", { id: "proposal-rule-record", class: "small" }, p.rule_record)] : null),
    restart ? el("div", { class: "buttons" }, el("button", { id: "proposal-restart", type: "button",
      onclick: () => onRestart({ ttt: p.suggested_ttt, clean: p.restart.clean }) }, `Restart at TTT=${p.suggested_ttt}…`)) : null,
    probePanel(p, onProbe),
    evidencePanel(p.evidence),
    p.auto_restart ? el("p", { id: "proposal-auto-restart", class: "muted small" }, `on_proposal: ${p.auto_restart}`) : null,
    p.advice ? el("p", { class: "muted small" }, `${p.advice.drafting?.description ?? ""}; ${p.advice.allreduce_basis}`) : null);
}

export function showRun(root, runId, signal) {
  const store = new MetricStore();
  let run = null, xMode = "step", smoothing = 0.6, shownStatus = null, shownAttempts = 0, noGpus = false;
  let logAttempt = null, logOffset = null, logNode = 0;

  const header = el("div", { class: "run-header" });
  const summary = el("div", { class: "summary", id: "summary" });
  const actions = el("div", { id: "actions" });
  const restartBox = el("div", { id: "restart" });
  const proposalBox = el("div", { id: "proposal" });
  const chartBoxes = CHARTS.map((c) => el("div", { class: "chart", id: `chart-${c.id}` }));
  const charts = CHARTS.map((c, i) => ({ spec: c, chart: null, box: chartBoxes[i] }));
  const xToggle = el("select", { id: "x-axis", onchange: (e) => { xMode = e.target.value; rebuildCharts(); } },
    el("option", { value: "step" }, "over steps"), el("option", { value: "time" }, "over time"));
  const smoothToggle = el("select", { id: "smoothing", onchange: (e) => { smoothing = Number(e.target.value); drawCharts(); } },
    ...[["0.6", "smoothed 0.6"], ["0.9", "smoothed 0.9"], ["0", "raw"]].map(([value, label]) => el("option", { value }, label)));
  const gpuNote = el("p", { id: "gpu-note", class: "muted small" });
  const simBox = el("div", { class: "chart", id: "chart-sim" });
  let simChart = null;
  const attemptsBox = el("div", { id: "attempts" });
  const evaluationBox = el("div", { id: "evaluation" });
  const logBox = el("pre", { id: "log", class: "log" });
  const follow = el("input", { type: "checkbox", id: "log-follow", checked: true });
  const nodeSelect = el("select", { id: "log-node", onchange: (e) => { logNode = Number(e.target.value); resetLog(); } });
  const notice = el("p", { id: "notice", class: "notice", role: "status" });

  replace(root,
    el("p", {}, el("a", { href: "#/" }, "← all runs")),
    header, notice, summary,
    section("Actions", "actions-card", actions, restartBox),
    section("Proposal", "proposal-card", proposalBox),
    section("Charts", "charts", el("div", { class: "toolbar" }, el("label", { class: "small" }, "x axis ", xToggle),
      el("label", { class: "small" }, "training curves ", smoothToggle)), gpuNote, el("div", { class: "grid" }, chartBoxes, simBox)),
    section("Attempts", "attempts-card", attemptsBox),
    section("Evaluation", "evaluation-card", evaluationBox),
    section("Log", "log-card", el("div", { class: "toolbar" }, el("label", {}, follow, " follow"), el("label", {}, "node ", nodeSelect)), logBox));

  const say = (text, isError = false) => replace(notice, text ? el("span", { class: isError ? "error" : "" }, text) : "");

  // the chart's names and title: its own, or its fallback's when the run has none of its own
  function chosen(spec) {
    const names = store.names(spec.match);
    if (names.length || !spec.fallback) return { names, title: spec.title };
    return { names: store.names(spec.fallback.match), title: spec.fallback.title };
  }

  function rebuildCharts() {
    for (const c of charts) {
      c.chart?.destroy();
      c.box.hidden = Boolean(c.spec.gpu && noGpus);
      c.chart = new LineChart(c.box, { title: chosen(c.spec).title, xLabel: xMode, xIsTime: xMode === "time",
        yLabel: c.spec.y, group: c.spec.group });
    }
    drawCharts();
  }

  function markers(lines) {
    if (!run || run.attempts.length < 2) return [];
    return run.attempts.slice(1).map((a) => {
      const depth = a.spec?.trainer?.ttt_steps;
      const label = `attempt ${a.number}${depth ? ` · TTT ${depth}` : ""}`;
      if (xMode === "time") return { x: Date.parse(a.started_at || a.created_at) / 1000, label };
      const steps = lines.filter((l) => l.attempt === a.number).flatMap((l) => l.points.map((p) => p[0]));
      return steps.length ? { x: Math.min(...steps), label } : null;
    }).filter(Boolean);
  }

  function drawCharts() {
    for (const c of charts) {
      if (c.box.hidden) continue;
      const { names, title } = chosen(c.spec);
      c.chart.title = title;
      const lines = store.lines(names, xMode, c.spec.smooth ? smoothing : 0);
      c.chart.update(lines, markers(lines));
    }
    drawSim();
  }

  // the simulated acceptance at each draft position k = 1..16 of each attempt's newest validation (trainer's
  // --sim-depth): how acceptance falls past the trained depth, while the run trains
  function drawSim() {
    simChart ??= new LineChart(simBox, { title: "Simulated acceptance by position (sim_acc_k, last validation)",
      xLabel: "position k", yLabel: "P(accepted | earlier accepted)" });
    const byAttempt = new Map();
    for (const name of store.names((n) => SIM_ACC_K.test(n))) {
      for (const [attempt, points] of store.byName.get(name)) {
        const newest = points.reduce((a, b) => ((b.step ?? -1) >= (a.step ?? -1) ? b : a));
        if (!byAttempt.has(attempt)) byAttempt.set(attempt, []);
        byAttempt.get(attempt).push([Number(SIM_ACC_K.exec(name)[1]), newest.value]);
      }
    }
    simChart.update([...byAttempt].sort((a, b) => a[0] - b[0])
      .map(([attempt, points]) => ({ name: S.sim_acc, attempt, points: points.sort((a, b) => a[0] - b[0]) })));
  }

  // a host whose snapshot says it has no usable GPU gets no GPU charts (they would say "no points yet" forever)
  async function checkGpus() {
    const hosts = await Promise.all(run.hosts.map((name) => api(`/v1/hosts/${encodeURIComponent(name)}`).catch(() => null)));
    const without = hosts.filter((h) => h && h.gpus && h.gpus.available === false);
    const none = without.length === run.hosts.length && !store.names((n) => /gpu_/.test(n)).length;
    replace(gpuNote, none ? `No GPU charts: ${without.map((h) => `${h.name} has no usable GPU (${h.gpus.message || "no nvidia-smi"})`).join("; ")}.` : "");
    if (none !== noGpus) { noGpus = none; rebuildCharts(); }
  }

  const loadMetrics = coalesced(async () => {
    const current = run?.attempt;
    const params = current && store.maxStep.has(current)
      ? { attempt: current, since_step: store.maxStep.get(current) - 1 } : {};
    // an answer holds whole series up to the server's cap per answer: the rest follow its next_cursor
    let answer = await api(runPath(runId, "/metrics"), { params });
    let added = store.add(answer.series);
    while (answer.next_cursor) {
      answer = await api(runPath(runId, "/metrics"), { params: { ...params, cursor: answer.next_cursor } });
      added += store.add(answer.series);
    }
    if (added || !charts[0].chart) {
      if (!charts[0].chart) rebuildCharts(); else drawCharts();
    }
  });

  function renderHeader() {
    replace(header, el("h1", {}, run.name, " ", statusBadge(run.status)),
      el("p", { class: "muted" }, `${run.id} · on ${run.hosts.join(", ")} · created ${when(run.created_at)}`),
      run.message ? el("p", { class: "message" }, run.message) : null);
  }

  function renderSummary() {
    const a = run.attempts.at(-1);
    const stepRate = a?.seconds_per_step ? 1 / a.seconds_per_step : null;
    const facts = [
      ["Progress", el("span", { id: "progress" }, progressBar(run.progress))],
      ["ETA", el("span", { id: "eta" }, duration(run.eta_seconds))],
      ["Step", a?.last_step !== null && a?.last_step !== undefined ? `${a.last_step}${a.total_steps ? ` / ${a.total_steps}` : ""}` : "—"],
      ["Steps/s", number(stepRate, 3)],
      ["Attempt", el("span", { id: "attempt" }, run.attempt)],
      ["TTT depth", tttDepth(run) ?? "—"],
      ["Last loss (TTT step 0)", el("span", { id: "last-loss", class: NOT_FINITE.has(comparableLoss(run.latest)) ? "warn" : null },
        number(comparableLoss(run.latest)))],
      ["Simulated τ at 16", el("span", { id: "sim-tau" }, number(run.latest?.[indexed(S.sim_tau, 16)], 3))],
      ["Host", run.host_reachable ? "reachable" : el("span", { class: "warn" }, "unreachable")],
    ];
    replace(summary, facts.map(([label, value]) => el("div", { class: "fact" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value))));
  }

  function renderActions() {
    const cancel = el("button", {
      id: "cancel", class: "danger", disabled: TERMINAL.has(run.status) || run.status === "cancelling",
      onclick: async () => {
        if (!confirm(`Cancel run ${run.name}? Its processes are stopped on every host.`)) return;
        try {
          await api(runPath(runId, "/cancel"), { method: "POST" });
          say("Cancel requested.");
          loadRun();
        } catch (error) { say(error.message, true); }
      },
    }, "Cancel run");
    // DELETE /v1/runs/{id}: an ended run only (the server refuses a live one, 409); its host files stay
    const remove = el("button", {
      id: "delete", class: "danger", disabled: !TERMINAL.has(run.status),
      title: TERMINAL.has(run.status) ? "forget the run, its metrics, logs and events" : "cancel it first: only an ended run can be deleted",
      onclick: async () => {
        if (!confirm(`Delete run ${run.name} (${run.id}) with its metrics, logs and events? Its files on the host stay.`)) return;
        try {
          await api(runPath(run.id), { method: "DELETE" });
          location.hash = "#/";
        } catch (error) { say(error.message, true); }
      },
    }, "Delete run");
    replace(actions, el("div", { class: "buttons" }, cancel, remove));
  }

  // prefill: {ttt, clean} from the proposal; the form then opens with its dry run asked for at once
  function restartForm(prefill = null) {
    const spec = run.spec;
    const trainer = spec.trainer;
    const fields = [];
    const input = (id, label, props, help) => {
      const field = el("input", { id, ...props });
      fields.push(field);
      return el("label", { class: "field" }, el("span", {}, label), field, help ? el("small", { class: "muted" }, help) : null);
    };
    const rows = [
      trainer ? input("restart-ttt", "TTT depth", { type: "number", min: 1, max: 64, value: String(prefill?.ttt ?? trainer.ttt_steps ?? 3) },
        "draft steps trained per position") : null,
      trainer ? null : input("restart-args", "Arguments", { type: "text", value: spec.args.join(" "), size: 60 },
        "separated by spaces; arguments that contain spaces go in Other overrides as JSON"),
      input("restart-nproc", "Processes per node", { type: "number", min: 1, value: String(spec.nproc_per_node) }),
      input("restart-retries", "Retries", { type: "number", min: 0, value: String(spec.max_retries) }),
      // where the new attempt starts: one choice, as `longrun restart --start` (README, "Restarting deeper")
      startChoice(trainer, prefill?.clean ? "fresh" : ""),
    ];
    const extra = el("textarea", { id: "restart-overrides", rows: 2, placeholder: '{"lr": 0.0001}' });
    fields.push(extra);
    const prediction = el("div", { id: "restart-prediction", class: "prediction" });
    const confirmButton = el("button", { id: "restart-confirm", disabled: true, type: "button" }, "Restart");
    let request = null;

    const value = (id) => fields.find((f) => f.id === id);
    function startChoice(forTrainer, chosen) {
      const options = forTrainer ? [
        ["", "as the trainer does: its newest checkpoint (refused over another TTT depth's)"],
        ["fresh", "fresh: empty the output directory, train from step 0"],
        ["resume", "resume: continue the checkpoint at the new depth, its remaining steps only"],
        ["warm", "warm: train from step 0 from the last exported draft's weights"],
      ] : [["", "as the script does with its output directory"], ["fresh", "fresh: empty the output directory first"]];
      const select = el("select", { id: "restart-start-from" },
        options.map(([v, label]) => el("option", { value: v, ...(v === chosen ? { selected: true } : {}) }, label)));
      fields.push(select);
      return el("label", { class: "field" }, el("span", {}, "Start"), select);
    }
    function build() {
      const overrides = {};
      if (trainer) {
        const depth = Number(value("restart-ttt").value);
        if (depth !== (trainer.ttt_steps ?? 3)) overrides.ttt_steps = depth;
      } else {
        const args = value("restart-args").value.trim().split(/\s+/).filter(Boolean);
        if (JSON.stringify(args) !== JSON.stringify(spec.args)) overrides.args = args;
      }
      const nproc = Number(value("restart-nproc").value), retries = Number(value("restart-retries").value);
      if (nproc !== spec.nproc_per_node) overrides.nproc_per_node = nproc;
      if (retries !== spec.max_retries) overrides.max_retries = retries;
      if (extra.value.trim()) {
        const parsed = JSON.parse(extra.value);
        if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("Other overrides must be a JSON object");
        Object.assign(overrides, parsed);
      }
      const start = value("restart-start-from").value;
      const body = { overrides, clean: start === "fresh" || start === "warm", init_from_last: start === "warm" };
      if (start === "resume") body.resume = true;
      return body;
    }

    const invalidate = () => { request = null; confirmButton.disabled = true; replace(prediction); };
    fields.forEach((f) => { f.addEventListener("input", invalidate); f.addEventListener("change", invalidate); });

    const preview = el("button", {
      id: "restart-preview", type: "button",
      onclick: async () => {
        invalidate();
        try {
          const body = build();
          const dry = await api(runPath(runId, "/restart"), { method: "POST", params: { dry_run: true }, body });
          const changes = specChanges(spec, dry.new_spec);
          replace(prediction,
            el("p", {}, "Predicted duration: ", el("strong", { id: "predicted-duration" }, duration(dry.predicted_duration_seconds)),
              dry.predicted_finish ? ` (finishing about ${when(dry.predicted_finish)})` : ""),
            el("p", { class: "muted small" }, dry.basis),
            el("p", { id: "restart-start" }, `Start: ${dry.start}${dry.start_reason ? `: ${dry.start_reason}` : ""}`),
            el("ul", { class: "changes" }, changes.length ? changes.map((c) => el("li", {}, c)) : el("li", {}, "no setting changes")),
            body.clean ? el("p", { class: "warn" }, "The output directory will be emptied.") : null,
            // the attempt has trained its last step: its final validation, evaluation and export run now
            run.status === "running" && (run.progress ?? 0) >= 1
              ? el("p", { id: "restart-evaluating", class: "warn" }, `Attempt ${run.attempt} has trained all its steps and is in its final evaluation: restarting now stops it and loses what it measures. Wait for it to end, or confirm to stop it.`)
              : null);
          request = body;
          confirmButton.disabled = false;
        } catch (error) {
          replace(prediction, el("p", { class: "error" }, error.message));
        }
      },
    }, "Predict duration");

    confirmButton.addEventListener("click", async () => {
      if (!request) return;
      try {
        await api(runPath(runId, "/restart"), { method: "POST", body: request });
        say("Restart requested.");
        invalidate();
        form.open = false;  // closed, the form is rebuilt from the new attempt's spec
        loadRun();
      } catch (error) { replace(prediction, el("p", { class: "error" }, error.message)); }
    });

    const form = el("details", { id: "restart-form", open: false },
      el("summary", {}, "Restart with changed settings"),
      el("form", { onsubmit: (e) => e.preventDefault() }, rows,
        el("label", { class: "field" }, el("span", {}, "Other overrides (JSON)"), extra),
        el("div", { class: "buttons" }, preview, confirmButton), prediction));
    return form;
  }

  function openRestart(prefill) {
    const form = restartForm(prefill);
    replace(restartBox, form);
    form.open = true;
    form.querySelector("#restart-preview").click();  // the dry run first
    form.scrollIntoView({ block: "nearest" });
  }

  async function takeProbe(button) {
    button.disabled = true;
    try {
      await api(runPath(runId, "/proposal/probe"), { method: "POST" });
      loadProposal();
    } catch (error) {
      button.disabled = false;
      button.after(el("p", { class: "error" }, error.message));
    }
  }

  // one verdict per run: the proposal panel and the evaluation panel's verdict line read the same answer
  let proposal = null;
  const verdictBox = el("p", { id: "evaluation-verdict", class: "verdict" });
  const loadProposal = coalesced(async () => {
    try {
      proposal = await api(runPath(runId, "/proposal"));
      replace(proposalBox, proposalPanel(proposal, openRestart, takeProbe));
    } catch (error) {
      replace(proposalBox, el("p", { class: "muted" }, error.message));
    }
    replace(verdictBox, verdictText(proposal));
  });

  function renderAttempts() {
    const rows = run.attempts.map((a, i) => {
      const changes = i ? specChanges(run.attempts[i - 1].spec, a.spec) : [];
      const took = a.actual_duration_seconds ?? (a.started_at && !a.ended_at ? (Date.now() - Date.parse(a.started_at)) / 1000 : null);
      return el("tr", { "data-attempt": a.number },
        el("td", { class: "num" }, a.number), el("td", {}, statusBadge(a.status)),
        el("td", {}, when(a.started_at)), el("td", { class: "num" }, duration(took)),
        el("td", { class: "num" }, duration(a.predicted_duration_seconds)),
        el("td", { class: "num" }, a.exit_code ?? "—"),
        el("td", {}, i ? (changes.length ? el("ul", { class: "changes" }, changes.map((c) => el("li", {}, c))) : "same spec") : "first",
          a.message ? el("div", { class: "muted small" }, a.message) : null));
    });
    replace(attemptsBox, el("table", {},
      el("thead", {}, el("tr", {}, ["#", "State", "Started", "Took", "Predicted", "Exit", "Changes / message"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)));
  }

  const accept = { position: null, depth: null };
  async function loadEvaluation() {
    let report;
    try {
      report = await api(runPath(runId, "/evaluation"));
    } catch (error) {
      replace(evaluationBox, el("p", { class: "muted" }, error.status === 404 ? "Not evaluated yet: the trainer evaluates at the end when the run has an eval_corpus." : error.message));
      return;
    }
    const positionBox = el("div", { class: "chart", id: "chart-acceptance" });
    const depthBox = el("div", { class: "chart", id: "chart-tau" });
    const adviceBox = el("div", { class: "advice-pair", id: "advice" });
    replace(verdictBox, verdictText(proposal));
    replace(evaluationBox, el("div", { class: "grid" }, positionBox, depthBox), verdictBox, adviceBox);
    accept.position = new LineChart(positionBox, { title: "Acceptance by position", xLabel: "position", yLabel: "P(all accepted)" });
    accept.depth = new LineChart(depthBox, { title: "τ by depth", xLabel: "depth", yLabel: "tokens per round" });
    accept.position.update(report.by_attempt.map((r) => ({
      name: "acceptance", attempt: r.attempt, points: r.position_acceptance.map((p, i) => [i + 1, p]) })));
    accept.depth.update(report.by_attempt.flatMap((r) => [
      { name: "τ", attempt: r.attempt, points: r.by_depth.map((d) => [d.depth, d.mean_accepted]) },
      { name: "τ measured", attempt: r.attempt, points: r.by_depth.filter((d) => d.measured_accepted !== null && d.measured_accepted !== undefined).map((d) => [d.depth, d.measured_accepted]) },
    ]));
    const answers = await Promise.all(["pcie", "nvlink"].map((interconnect) =>
      api(runPath(runId, "/advice"), { params: { interconnect } }).then(advicePanel, (error) => el("p", { class: "error" }, `${interconnect}: ${error.message}`))));
    replace(adviceBox, answers);
  }

  function resetLog() {
    logOffset = null;
    replace(logBox);
    loadLogs();
  }

  const loadLogs = coalesced(async () => {
    if (!run) return;
    if (logAttempt !== run.attempt) {
      if (logAttempt !== null) logBox.append(document.createTextNode(`──── attempt ${run.attempt} ────\n`));
      logAttempt = run.attempt;
      logOffset = null;
    }
    let answer;
    try {
      answer = await api(runPath(runId, "/logs"), { params: logOffset === null
        ? { tail: 200, node: logNode, attempt: logAttempt } : { since_offset: logOffset, node: logNode, attempt: logAttempt } });
    } catch (error) {
      if (error.status !== 404) say(error.message, true);
      return;
    }
    logOffset = answer.next_offset;
    if (answer.lines.length) {
      const atBottom = logBox.scrollTop + logBox.clientHeight >= logBox.scrollHeight - 20;
      logBox.append(document.createTextNode(answer.lines.map(visibleControls).join("\n") + "\n"));
      while (logBox.childNodes.length > LOG_KEEP_READS) logBox.firstChild.remove();
      if (follow.checked && atBottom) logBox.scrollTop = logBox.scrollHeight;
    }
  });

  function renderNodes() {
    const nodes = run.attempts.at(-1)?.nodes || [];
    if (nodeSelect.options.length === Math.max(1, nodes.length)) return;
    replace(nodeSelect, (nodes.length ? nodes : [{}]).map((n, i) => el("option", { value: String(i), selected: i === logNode }, `${i}${n.host ? ` (${n.host})` : ""}`)));
  }

  const loadRun = coalesced(async () => {
    try {
      run = await api(runPath(runId));
    } catch (error) {
      say(error.message, true);
      return;
    }
    renderHeader();
    renderSummary();
    renderNodes();
    renderAttempts();
    if (run.status !== shownStatus || run.attempts.length !== shownAttempts) {
      renderActions();
      if (!restartBox.querySelector("#restart-form[open]")) replace(restartBox, restartForm());
      loadEvaluation();
      loadProposal();
      loadLogs();
      if (run.attempts.length !== shownAttempts && shownAttempts) loadMetrics();
      if (shownStatus !== null) checkGpus();
      shownStatus = run.status;
      shownAttempts = run.attempts.length;
    }
  });

  (async () => {
    await loadRun();
    if (!run) return;
    await loadMetrics();
    checkGpus();
    followEvents(runId, (event) => {
      if (event.kind === "metrics") loadMetrics();
      if (event.kind === "proposal") loadProposal();
      loadRun();
    }, signal);
  })();
  const timers = [
    setInterval(loadRun, RUN_POLL_MS),
    setInterval(() => { if (follow.checked) loadLogs(); }, LOG_POLL_MS),
  ];
  const onResize = () => charts.concat([{ chart: accept.position }, { chart: accept.depth }, { chart: simChart }])
    .forEach((c) => c.chart?.resize());
  window.addEventListener("resize", onResize);
  signal.addEventListener("abort", () => {
    timers.forEach(clearInterval);
    window.removeEventListener("resize", onResize);
    charts.forEach((c) => c.chart?.destroy());
  });
}
