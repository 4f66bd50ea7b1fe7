"""The depth proposal, built: after each validation, whether a deeper TTT restart pays off on the deployment box.

Inputs, all the run's own: the latest `sim_acc_k` of the current attempt (the draft's conditional acceptance at
draft position k on validation data, chain drafting, greedy: trainer/simulate.py), its trained TTT depth, the
run's measured step time (through the restart dry run), and the spec's `deploy: {host, tp, engine}`, whose host's
all-reduce table was measured by probe-interconnect. The advisor (server/advisor) prices every depth there the
way the engine runs the draft; its retrain rule (RETRAIN_ASSUMPTION) says how positions beyond the trained depth
improve after a deeper TTT. The answer is "restart at TTT=N" (with the dry run's duration, the GPU-hours and
the tokens/s gained), "keep going" (with why), or "cannot tell yet" where the evidence's 90% interval holds both
(the verdict at one end of it is not the verdict at the other). It is the run's one verdict: the page's
evaluation panel, `longrun advise RUN_ID`, the SSE `proposal` event and the webhook all carry this answer.

The evidence is named in every answer with its sample sizes and interval: the simulation (sim_acc_k and, for the
retrain rule, sim_step_acc_k, which has no survivor bias: trainer/simulate.py; Wilson intervals from the rounds
behind each rate, sim_rounds_k and sim_scored_k), or decoding once an evaluation of the run exists (its bootstrap
interval over prompts).

`build` reads what is stored and changes nothing; server/proposal.py stores the `proposal` events, answers GET
/v1/runs/{id}/proposal and acts on a proposal (on_proposal: restart, the probe).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from server import eta, hosts, pace, views
from server.advisor import Drafting, advise, rule_record
from server.advisor import probe as probes
from server.advisor.depth import UNKNOWN_LINKS, lifted_positions, training_cost
from server.advisor.evidence import (
    CONFIDENCE,
    FALLBACK_NOTE,
    STEP_NOTE,
    Evidence,
    interval_ends,
    products,
    said,
    settle_text,
    simulation_evidence,
    unit,
)
from server.advisor.probe import ProbePublic
from server.advisor.results import Advice, FrontierRow, Objective
from server.advisor.served import cost_model, engine_refusal
from server.errors import Conflict, NotFound
from server.lifecycle import TERMINAL
from server.models import MetricPoint, Run, utcnow
from server.retrain_time import retrain_seconds, with_ttt
from server.schemas import DryRunPublic, without_env_values
from server.spec import RunCreate, spec_dict
from trainer import series

SIM_ACC = series.indexed_pattern(series.SIM_ACC)
MAX_SIM_DEPTH = 64
# the evidence's intervals: 90% two-sided, as decoding's bootstrap (trainer/evaluate.py CONFIDENCE)
# the least serving speed-up worth a restart (the advisor's min_gain)
MIN_GAIN = 0.02

Action = Literal["restart", "probe", "keep_going", "cannot_tell", "unavailable"]
# the tokens a draft serves over its life where the spec gives no deploy.serve_tokens: a stated default, so that a
# restart is weighed against its training cost (net GPU-hours) rather than picked by its tokens/s alone
DEFAULT_SERVE_TOKENS = 1e9


class ProposalPublic(BaseModel):
    """The service's proposal for a run: restart at a deeper TTT, keep going, or why it cannot say."""

    run_id: str
    attempt: int
    action: Action
    summary: str = Field(description="one line: the proposal and its figures")
    reason: str = Field(description="why: the advisor's retrain reasoning, or what is missing")
    step: int | None = Field(None, description="the training step of the validation the proposal rests on")
    trained_ttt: int | None = None
    suggested_ttt: int | None = None
    deploy: dict[str, Any] | None = None
    sim_acc: list[float] = Field(default_factory=list, description="[k-1]: sim_acc_k, conditional acceptance")
    sim_tau: list[float] = Field(default_factory=list, description="[d-1]: sim_tau_d as the trainer reported it")
    depth_now: int | None = Field(None, description="the depth to serve the draft as it is (0: do not speculate)")
    tokens_per_second_now: float | None = None
    depth_after: int | None = Field(None, description="the depth to serve after the restart")
    tokens_per_second_after: float | None = None
    gain: float | None = Field(None, description="tokens_per_second_after / tokens_per_second_now - 1")
    predicted_tau_after: float | None = Field(
        None, description="tokens per verifier pass at depth_after that a deeper TTT is expected to reach (also "
        "with keep_going: there it is why a restart does not pay)")
    predicted_position_acceptance_after: list[float] = Field(default_factory=list)
    predicted_training_seconds: float | None = Field(None, description="the restart's dry run: its whole duration")
    remaining_seconds: float | None = Field(None, description="the current attempt's ETA")
    extra_training_seconds: float | None = Field(None, description="predicted_training_seconds - remaining_seconds")
    gpus: int | None = Field(None, description="GPUs the run trains on (processes per node x nodes)")
    restart_gpu_hours: float | None = Field(None, description="the restarted attempt's GPU-hours")
    extra_gpu_hours: float | None = Field(None, description="GPU-hours beyond finishing the current attempt")
    break_even_tokens: float | None = Field(
        None, description="tokens served after which the extra GPU-hours are won back by serving faster (GPU-time "
        "saved per token on the deployment's tp GPUs); the frontier's, the reason's and the summary's figure")
    restart: dict[str, Any] | None = Field(None, description="the body of POST /v1/runs/{id}/restart it proposes")
    dry_run: DryRunPublic | None = None
    verifier: str | None = Field(None, description="the verifier priced: its config.json's shape, or the built-in "
                                 "default and why")
    terms_basis: dict[str, str] = Field(default_factory=dict, description="each cost term and whether it was "
                                        "measured or modelled (advice.cost_model.basis)")
    objective: str | None = Field(None, description="how the TTT was picked among the frontier's")
    frontier: list[FrontierRow] = Field(default_factory=list, description="every candidate TTT: serve depth, "
                                        "tokens/s, training hours, GPU-hours, tokens served to break even")
    advice: Advice | None = Field(None, description="the advisor's full answer on the deployment box, with terms")
    auto_restart: str = Field("", description="what on_proposal: restart did with this proposal: taken, refused and "
                              "why, or off")
    probe: ProbePublic | None = Field(None, description="the measurement that settles it: resume the checkpoint at "
                                      "the candidate TTT for N steps, then decide on measured acceptance")
    next_step: str = Field("", description="what settles a cannot_tell or a probe: never a bare cannot_tell")
    rule_record: str | None = Field(None, description="for a restart the advisor would make: how the retrain rule's "
                                    "predictions for restarts like it measured against trained drafts "
                                    "(server/advisor/rule_record.py); past a 10% miss the answer is cannot_tell")
    evidence: Evidence | None = Field(None, description="the acceptance the decision read: the simulation "
                                      "(sim_acc_k), or the simulation calibrated per position by decoding")

    @property
    def key(self) -> list[Any]:
        """What makes a proposal a different one: a new event is stored when this changes."""
        return [self.attempt, self.action, self.suggested_ttt, self.depth_after,
                self.evidence.source if self.evidence else None]


def sim_metrics(latest: dict[str, Any]) -> tuple[list[float], list[float]]:
    """sim_acc_1..K (contiguous from 1) and sim_tau_1..K from the run's latest values."""
    found = {int(m.group(1)): v for k, v in latest.items() if (m := SIM_ACC.match(k)) and isinstance(v, int | float)}
    accs: list[float] = []
    while len(accs) + 1 in found and len(accs) < MAX_SIM_DEPTH:
        accs.append(min(1.0, max(0.0, float(found[len(accs) + 1]))))
    taus = []
    for d in range(1, len(accs) + 1):
        value = latest.get(series.indexed(series.SIM_TAU, d))
        if not isinstance(value, int | float):
            break
        taus.append(float(value))
    return accs, taus


def _sim_acc_of(session: Session, run_id: str, attempt: int) -> list[float]:
    """An attempt's sim_acc_1..K at its last validation (the step of its last sim_acc_1)."""
    first = series.indexed(series.SIM_ACC, 1)
    step = session.scalar(select(MetricPoint.step).where(
        MetricPoint.run_id == run_id, MetricPoint.attempt == attempt, MetricPoint.name == first)
        .order_by(MetricPoint.id.desc()).limit(1))
    if step is None:
        return []
    rows = session.execute(select(MetricPoint.name, MetricPoint.value).where(
        MetricPoint.run_id == run_id, MetricPoint.attempt == attempt, MetricPoint.step == step,
        MetricPoint.name.like(f"{series.SIM_ACC}_%")))
    return sim_metrics({name: value for name, value in rows})[0]


def _verdict(advice: Advice, trained: int) -> str:
    retrain = advice.retrain
    return "restart" if retrain.pays_off and (retrain.suggested_ttt_steps or 0) > trained else "keep_going"


def acceptance_evidence(session: Session, run: Run, accs: list[float],
                        latest: dict[str, Any] | None = None) -> Evidence:
    """The conditional acceptance by draft position the decision reads, and from what.

    With an evaluation of the run (the end of an attempt, or --eval-every) whose attempt also reported sim_acc_k:
    at each position decoding measured, the live sim_acc_k times decoding / simulation of that attempt (its last
    validation); beyond decoding's depth, times the deepest position's ratio. The live sim_step_acc_k, where
    reported, are calibrated by the same ratios for the retrain rule. The evaluated attempt being the live one, its
    decoding is read as it is. Without one, the simulation alone, and the answer says so."""
    latest = latest if latest is not None else run.latest or {}
    simulated = simulation_evidence(latest, accs)
    try:
        reports = views.evaluations(run)
    except Conflict:
        return simulated
    for report in reversed(reports):
        decoded = [unit(v) for v in report.conditional_acceptance or []]
        sim_then = _sim_acc_of(session, run.id, report.attempt)
        depth = 0
        while depth < min(len(decoded), len(sim_then)) and decoded[depth] is not None and sim_then[depth] > 0:
            depth += 1
        if depth:
            break
    else:
        return simulated
    ratios = [decoded[k] / sim_then[k] for k in range(depth)]
    ratios += [ratios[-1]] * (len(accs) - depth)
    extra = report.model_extra or {}
    bounds = extra.get("conditional_acceptance_interval") or []
    calibrated, intervals = [], []
    for k, (a, f) in enumerate(zip(accs, ratios, strict=False)):
        calibrated.append(min(1.0, a * f))
        bound = bounds[k] if k < depth and k < len(bounds) else None
        low, high = (unit(b) for b in bound) if isinstance(bound, list) and len(bound) == 2 else (None, None)
        intervals.append([min(1.0, a * low / sim_then[k]), min(1.0, a * high / sim_then[k])]
                         if low is not None and high is not None else None)
    # decoding's own uncertainty, relative, carried onto the calibrated step rates with the simulation's own
    step, step_bounds = simulated.step_acceptance, simulated.step_acceptance_interval
    if step:
        step = [min(1.0, u * f) for u, f in zip(step, ratios, strict=False)]
        step_bounds = [[min(1.0, b[0] * f), min(1.0, b[1] * f)] if b else None
                       for b, f in zip(step_bounds, ratios, strict=False)]
    live = report.attempt == run.attempt
    position_rounds = [int(r) for r in extra.get("position_rounds") or [] if isinstance(r, int | float)][:depth]
    prompts = extra.get("prompts")
    prompts = int(prompts) if isinstance(prompts, int | float) and not isinstance(prompts, bool) else None
    interval = (f"decoding's {CONFIDENCE:.0%} bootstrap over {prompts or 'its'} prompts (the unit: rounds of one "
                "prompt are not independent), carried through the calibration" if any(intervals)
                else "none: the evaluation reports no conditional_acceptance_interval")
    detail = (f"decoding: attempt {report.attempt}'s evaluation (real decoding with the verifier, "
              f"{depth} position(s)) calibrates the live sim_acc_k per position by decoding / simulation "
              f"({' '.join(f'{f:.3f}' for f in ratios[:depth])})" + (
                  f", beyond position {depth} by position {depth}'s" if len(accs) > depth else "")
              + ("; it is this attempt's, so its positions read as decoded" if live else "")
              + ("; the live sim_step_acc_k are calibrated by the same ratios" if step else ""))
    return Evidence(source="decoding", detail=detail, attempt=report.attempt, acceptance=calibrated,
                    acceptance_interval=intervals, calibration=ratios, rounds=position_rounds, prompts=prompts,
                    interval=interval, step_acceptance=step, step_acceptance_interval=step_bounds,
                    decay_from="sim_step_acc_k" if step else "sim_acc_k",
                    decay_note=STEP_NOTE if step else FALLBACK_NOTE)


def _dry_run(measured: list[eta.Measured], spec: RunCreate) -> DryRunPublic:
    """What POST /v1/runs/{id}/restart?dry_run=true answers for this spec (server/runs.py dry_run_restart)."""
    seconds, basis = eta.predict_duration(measured, spec)
    finish = utcnow() + timedelta(seconds=seconds) if seconds is not None else None
    return DryRunPublic(new_spec=without_env_values(spec_dict(spec)), predicted_duration_seconds=seconds,
                        predicted_finish=finish, basis=basis)


def _remaining_seconds(run: Run) -> float | None:
    """The current attempt's ETA from its measured pace (server/views.py progress_and_eta)."""
    a = run.current
    if a.sec_per_step is None:
        return None
    since = (utcnow() - a.step_seen_at).total_seconds() if a.step_seen_at else 0.0
    return eta.remaining_seconds(a.total_steps, a.last_step, a.sec_per_step, since)


def _unavailable(run: Run, why: str, **fields: Any) -> ProposalPublic:
    return ProposalPublic(run_id=run.id, attempt=run.attempt, action="unavailable",
                          summary=f"no proposal yet: {why}", reason=why, **fields)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.3g} h"


def _objective(spec: RunCreate, remaining: float | None) -> Objective:
    deploy = spec.deploy
    serve = deploy.serve_tokens if deploy.serve_tokens is not None else DEFAULT_SERVE_TOKENS
    return Objective(serve_tokens=serve, train_gpus=spec.gpus, remaining_seconds=remaining or 0.0,
                     train_gpu_hour_price=deploy.train_gpu_hour_price, serve_gpu_hour_price=deploy.serve_gpu_hour_price)


def build(session: Session, run: Run, measured: list[eta.Measured] | None = None) -> ProposalPublic:
    """The proposal for the run's current attempt from what is stored now; changes nothing. `measured`: the
    paces the dry run predicts from (default: the run's own attempts)."""
    measured = pace.own_paces(run) if measured is None else measured
    spec = run.current.typed_spec
    deploy = spec.deploy
    latest = run.latest or {}
    accs, taus = sim_metrics(latest)
    if deploy and deploy.max_depth:
        accs, taus = accs[:deploy.max_depth], taus[:deploy.max_depth]
    step = session.scalar(select(MetricPoint.step).where(
        MetricPoint.run_id == run.id, MetricPoint.attempt == run.attempt, MetricPoint.name == series.indexed(series.SIM_ACC, 1))
        .order_by(MetricPoint.id.desc()).limit(1)) if accs else None
    base = {"step": step, "sim_acc": accs, "sim_tau": taus, "deploy": deploy and deploy.model_dump(mode="json", exclude_none=True)}
    if not deploy:
        return _unavailable(run, "the run spec has no `deploy: {host, tp, engine}` to price depths on", **base)
    if run.status in TERMINAL:
        return _unavailable(run, f"the run is {run.status}: there is no attempt to restart", **base)
    if refused := engine_refusal(session, spec):
        return _unavailable(run, refused, **base)
    if not accs:
        return _unavailable(run, "no sim_acc_k metrics in this attempt yet: they arrive with each validation "
                            "(the bundled trainer's --sim-depth)", **base)
    trained = eta.ttt_of(spec)
    if trained is None:
        return _unavailable(run, "the trained TTT depth is unknown (not a bundled-trainer run), so a deeper restart "
                            "cannot be proposed", **base)
    remaining = _remaining_seconds(run)
    evidence = acceptance_evidence(session, run, accs, latest)
    base["evidence"] = evidence
    try:
        tp, links, table, basis = hosts.measured_allreduce(session, deploy.host, deploy.tp)
        links = links or UNKNOWN_LINKS
        cost = cost_model(session, spec, tp, table)
        drafting = drafting_of(deploy)

        def advice_on(conditional: list[float], step: list[float] | None) -> Advice:
            evaluation = {"position_acceptance": products(conditional), "by_depth": [],
                          **({"step_acceptance": step} if step else {})}
            return advise(evaluation, links, tp, cost,
                          trained_ttt=trained, retrain_seconds_by_ttt=retrain_seconds(measured, spec, len(accs)),
                          min_gain=MIN_GAIN, allreduce_basis=basis if tp > 1 else None, drafting=drafting,
                          objective=_objective(spec, remaining))

        positions = products(evidence.acceptance)
        step = evidence.step_acceptance or None
        advice = advice_on(evidence.acceptance, step)
        verdict = _verdict(advice, trained)
        at_ends = [advice_on(c, u) for c, u in interval_ends(evidence, trained)]
        if at_ends:
            evidence.verdicts = [_verdict(a, trained) for a in at_ends]
            pick = advice.retrain.suggested_ttt_steps
            gains = [next((r.gain for r in a.retrain.frontier if r.ttt == pick), a.retrain.gain) if pick
                     else a.retrain.gain for a in at_ends]
            gains = [g for g in [advice.retrain.gain, *gains] if g is not None]
            if gains:
                evidence.gain_interval = [min(gains), max(gains)]
            if any(v != verdict for v in evidence.verdicts):
                evidence.settle = settle_text(evidence, trained, verdict, lambda c, u: _verdict(advice_on(c, u), trained))
    except (NotFound, Conflict) as exc:
        return _unavailable(run, f"deploy host: {exc}", **base)
    except ValueError as exc:
        return _unavailable(run, f"the advisor cannot price this deployment: {exc}", **base)
    retrain = advice.retrain
    fields: dict[str, Any] = {
        **base, "trained_ttt": trained, "advice": advice, "depth_now": advice.recommended_depth,
        "tokens_per_second_now": advice.tokens_per_second, "depth_after": retrain.depth_after,
        "tokens_per_second_after": retrain.tokens_per_second_after, "gain": retrain.gain,
        "verifier": advice.cost_model.priced_verifier, "terms_basis": advice.cost_model.basis,
        "frontier": retrain.frontier, "remaining_seconds": remaining,
        "objective": retrain.objective + (f" (deploy.serve_tokens not given: the stated default, {DEFAULT_SERVE_TOKENS:.0e} "
                                          "tokens; GPU-hours weighed 1:1 without prices)"
                                          if retrain.objective and deploy.serve_tokens is None else ""),
    }
    where = f"{deploy.host} ({advice.interconnect}{' links' if links == UNKNOWN_LINKS else ''}, tp={tp}, " \
            f"{drafting.engine})"
    if retrain.depth_after is not None:
        # what a deeper TTT is expected to reach (RETRAIN_ASSUMPTION), whether or not it pays off
        after = lifted_positions(positions, trained, retrain.suggested_ttt_steps or len(positions), step)
        fields |= {"predicted_position_acceptance_after": after,
                   "predicted_tau_after": 1 + sum(after[:retrain.depth_after])}
    if any(v != verdict for v in evidence.verdicts):
        # the interval holds a restart and a keep going: no verdict either way until the evidence narrows
        low, high = evidence.gain_interval or [retrain.gain, retrain.gain]
        at_rates = (f"restart at TTT={retrain.suggested_ttt_steps} ({retrain.gain:+.1%})" if verdict == "restart"
                    else "keep going")
        candidate = retrain.suggested_ttt_steps
        offer = probes.plan(run, spec, measured, candidate, trained, MIN_GAIN) if (candidate or 0) > trained else None
        return ProposalPublic(
            run_id=run.id, attempt=run.attempt, action="cannot_tell", reason=retrain.reason, **fields, probe=offer,
            next_step=evidence.settle + (f"; or at once: {probes.describe(offer)}" if offer else ""),
            summary=(f"cannot tell yet: at the measured acceptance the advisor says {at_rates} on {where}, but over the "
                     f"evidence's 90% intervals the gain runs {low:+.1%} to {high:+.1%} and "
                     f"{evidence.verdicts.count('restart')} of the {len(evidence.verdicts)} ends say restart; "
                     f"{evidence.settle}; {said(evidence, with_gain=False)}"))
    if verdict == "keep_going":
        return ProposalPublic(
            run_id=run.id, attempt=run.attempt, action="keep_going", reason=retrain.reason, **fields,
            summary=(f"keep going: the advisor predicts {advice.tokens_per_second:.1f} tokens/s at depth "
                     f"{advice.recommended_depth} on {where}; {retrain.reason}; {said(evidence)}"))

    ttt = retrain.suggested_ttt_steps
    trusted, record = rule_record.judge(trained, ttt, advice.interconnect)
    fields["rule_record"] = record
    if not trusted:
        # the rule's gain is a prediction, and on restarts like this one it has missed: measure it before restarting
        offer = probes.plan(run, spec, measured, ttt, trained, MIN_GAIN)
        return ProposalPublic(
            run_id=run.id, attempt=run.attempt, action="probe", reason=retrain.reason, **fields, probe=offer,
            suggested_ttt=ttt, next_step=probes.describe(offer),
            summary=(f"{probes.describe(offer)}: the advisor predicts restart at TTT={ttt} ({retrain.gain:+.1%}, "
                     f"{retrain.tokens_per_second_after:.1f} against {advice.tokens_per_second:.1f} tokens/s on "
                     f"{where}), but {record}; {said(evidence)}"))
    restart = {"overrides": {"ttt_steps": ttt}, "clean": True}
    fields |= {"suggested_ttt": ttt, "restart": restart}
    dry = _dry_run(measured, with_ttt(spec, ttt))
    fields["dry_run"] = dry
    seconds = dry.predicted_duration_seconds
    gpus = spec.gpus
    fields |= {"gpus": gpus, "predicted_training_seconds": seconds}
    training = "the dry run has no measured step to predict from yet"
    row = next((r for r in retrain.frontier if r.ttt == ttt), None)
    if seconds is not None and row is not None and row.training_seconds is not None:
        fields |= {"restart_gpu_hours": row.gpu_hours, "break_even_tokens": retrain.break_even_tokens}
        if remaining is not None:
            fields |= {"extra_training_seconds": seconds - remaining, "extra_gpu_hours": row.extra_gpu_hours}
        objective = _objective(spec, remaining)
        training = "the dry run predicts " + (training_cost(row, objective, tp) if remaining is not None else (
            f"{seconds:.0f} s of training ({row.gpu_hours:.3g} GPU-h on {gpus} GPU(s)); this attempt's ETA is "
            f"unknown, so the whole restart is counted, won back after {retrain.break_even_tokens:.3g} tokens served"))
    return ProposalPublic(
        run_id=run.id, attempt=run.attempt, action="restart", reason=retrain.reason, **fields,
        summary=(f"restart at TTT={ttt}: {training}; the advisor predicts {retrain.tokens_per_second_after:.1f} "
                 f"tokens/s at depth {retrain.depth_after} on {where} against {advice.tokens_per_second:.1f} "
                 f"now at depth {advice.recommended_depth} ({retrain.gain:+.1%}); {record}; {said(evidence)}"))


def sim_acc_of(session: Session, run_id: str, attempt: int) -> list[float]:
    return _sim_acc_of(session, run_id, attempt)


def drafting_of(deploy: Any) -> Drafting:
    """How the spec's deploy engine runs the draft."""
    return Drafting(engine=deploy.engine, topk=deploy.topk, draft_tp=deploy.draft_tp, engine_version=deploy.engine_version,
                    round_ms=deploy.round_ms or None, attention_dp=deploy.dp_attention or 1)


def serving_speed(session: Session, run: Run, conditional: list[float]) -> float:
    """Tokens/s on the run's deployment of a draft with this conditional acceptance, served at its best depth."""
    spec = run.current.typed_spec
    deploy = spec.deploy
    tp, links, table, basis = hosts.measured_allreduce(session, deploy.host, deploy.tp)
    drafting = drafting_of(deploy)
    evaluation = {"position_acceptance": products(conditional[:deploy.max_depth or None]), "by_depth": []}
    return advise(evaluation, links or UNKNOWN_LINKS, tp, cost_model(session, spec, tp, table),
                  allreduce_basis=basis if tp > 1 else None, drafting=drafting).tokens_per_second
