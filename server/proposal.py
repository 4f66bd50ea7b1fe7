"""What the service does with a run's depth proposal (server/advisor/proposing.py builds it): the `proposal` events, what
`on_proposal: restart` takes and what it refuses (always said on GET /v1/runs/{id}/proposal as `auto_restart`), the
probe taken (by POST /v1/runs/{id}/proposal/probe or by itself) and its decision once its validation is in
(server/advisor/probe.py).

An automatic restart: at most once per run, never over a restart made by hand since the run's first proposal, only
where the restart's own checks pass (its dry run), and never one that multiplies what is left of the run by more
than `auto_restart_max_factor` (default 2): a restart's whole predicted duration, or a probe's time plus the rest of
the run at the deeper TTT, against the current attempt's ETA.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server import eta, pace
from server.advisor import probe as probes
from server.advisor.proposing import (  # noqa: F401 - ProposalPublic: the route's answer
    MIN_GAIN,
    ProposalPublic,
    build,
    serving_speed,
    sim_acc_of,
    sim_metrics,
)
from server.errors import Conflict, FieldError, NotFound
from server.lifecycle import TERMINAL, RunStatus, TransitionError, restart_run
from server.models import Attempt, Event, Run
from server.retrain_time import with_ttt
from server.wakeup import wake_workers

log = logging.getLogger("longrun.proposal")

# how server/runs.py request_restart words a restart asked for by hand (its status event's message)
HAND_RESTART_MESSAGE = "restart requested"
DEFAULT_MAX_FACTOR = 2.0
OFF = "off: the spec has no `on_proposal: restart`, so the service only proposes"


def proposal_events(session: Session, run_id: str) -> list[Event]:
    return list(session.scalars(select(Event).where(Event.run_id == run_id, Event.kind == "proposal")
                                .order_by(Event.id)))


def event_data(proposal: ProposalPublic) -> dict[str, Any]:
    """What a `proposal` event carries: the decision and its figures, not the whole advice."""
    return {**proposal.model_dump(mode="json", exclude={"advice", "dry_run", "predicted_position_acceptance_after"}),
            "predicted_duration_seconds": proposal.predicted_training_seconds, "key": proposal.key}


def _taken(events: list[Event]) -> Event | None:
    """The automatic restart or probe the run took, if any (a probe's decision and a probe taken by hand are not)."""
    return next((e for e in events if e.data.get("restarted_to_attempt") and not e.data.get("probe_decided")
                 and e.data.get("auto", True)), None)


def current(session: Session, run: Run, measured: list[eta.Measured]) -> ProposalPublic:
    """The proposal, with what on_proposal: restart did with it or would do, and the probe under way if any."""
    proposal = build(session, run, measured)
    events = proposal_events(session, run.id)
    running = probes.running(events, run)
    if running is not None:
        proposal.probe = probes.ProbePublic(**{**running.data["probe_taken"], "status": "running"})
        proposal.next_step = (f"the probe (attempt {run.attempt}) decides at its validation: "
                              f"{proposal.probe.decides}")
        if proposal.action == "unavailable":
            proposal.summary = (f"probe under way: attempt {run.attempt} trains TTT={proposal.probe.ttt} for "
                                f"{proposal.probe.steps} steps; {proposal.next_step}")
    decided = next((e for e in reversed(events) if e.data.get("probe_decided")), None)
    if running is None and decided is not None and proposal.probe is None:
        proposal.probe = probes.ProbePublic(**decided.data["probe_decided"])
    proposal.auto_restart = auto_restart_text(session, run, proposal, events)
    return proposal


def auto_restart_text(session: Session, run: Run, proposal: ProposalPublic, events: list[Event]) -> str:
    """Taken, refused and why, or off: never empty."""
    spec = run.current.typed_spec
    if (taken := _taken(events)) is not None:
        return str(taken.data.get("auto_restart") or "taken")
    if spec.on_proposal != "restart":
        return OFF
    if proposal.action not in ("restart", "probe"):
        return f"nothing to take: the proposal is {proposal.action.replace('_', ' ')}"
    refusal = refusal_of(session, run, proposal, events)
    return f"refused: {refusal}" if refusal else "to be taken at the next validation"


def _hand_restart_since(session: Session, run: Run, first: Event) -> Event | None:
    """A restart asked for by hand (POST /v1/runs/{id}/restart) after the run's first proposal."""
    return next((e for e in session.scalars(select(Event).where(
        Event.run_id == run.id, Event.kind == "status", Event.id > first.id).order_by(Event.id))
        if e.data.get("to") == RunStatus.RESTARTING and str(e.data.get("message") or "").startswith(
            HAND_RESTART_MESSAGE)), None)


def _factor_refusal(run: Run, proposal: ProposalPublic) -> str | None:
    """Why the restart would multiply what is left of the run by more than auto_restart_max_factor, or None."""
    spec = run.current.typed_spec
    factor = spec.auto_restart_max_factor or DEFAULT_MAX_FACTOR
    remaining = proposal.remaining_seconds
    if proposal.action == "probe" and proposal.probe is not None:
        seconds = proposal.probe.predicted_seconds
        measured = pace.own_paces(run)
        if seconds is not None and remaining is not None and measured:
            a, b, _ = eta.step_cost_model(measured)
            trained = proposal.trained_ttt or 1
            seconds += remaining * (a + b * proposal.probe.ttt) / (a + b * trained)
    else:
        seconds = proposal.predicted_training_seconds
    if seconds is None or not remaining:
        return "the current attempt's ETA or the restart's duration is unknown, so its cost cannot be bounded"
    if seconds > factor * remaining:
        return (f"it would take {seconds / 3600:.3g} h against the {remaining / 3600:.3g} h this attempt has left "
                f"({seconds / remaining:.2f}x), past auto_restart_max_factor {factor:g}: take it by hand, or raise "
                "auto_restart_max_factor in the spec")
    return None


def refusal_of(session: Session, run: Run, proposal: ProposalPublic, events: list[Event]) -> str | None:
    """Why on_proposal: restart must not take this proposal, or None. Every precondition of the restart is checked
    here, before anything is stopped: the restart's own validation (server/runs.py, as its dry run does)."""
    from server import runs  # runs -> queries -> proposal
    from server.schemas import RestartRequest

    if (taken := _taken(events)) is not None:
        return (f"on_proposal: restart took a proposal once already (attempt {taken.data['restarted_to_attempt']}); "
                "no further automatic restart")
    if run.status != RunStatus.RUNNING:
        return f"the run is {run.status}, not running"
    if events and (hand := _hand_restart_since(session, run, events[0])) is not None:
        return (f"the run was restarted by hand at {hand.time:%Y-%m-%d %H:%M:%S} UTC (attempt {hand.data.get('attempt')})"
                " since its first proposal; an automatic restart never overrides that: restart it yourself to "
                "take this proposal")
    body = proposal.probe.restart if proposal.action == "probe" and proposal.probe else proposal.restart
    try:
        runs.dry_run_restart(session, run.id, RestartRequest(**body))
    except (FieldError, Conflict, NotFound) as exc:
        return f"the restart would not succeed, so the attempt is left running: {exc}"
    return _factor_refusal(run, proposal)


def take_probe(session: Session, run: Run, proposal: ProposalPublic, auto: bool = False) -> Attempt:
    """Start the probe the proposal offers: the current checkpoint resumed at the candidate TTT for N steps."""
    from server import runs
    from server.schemas import RestartRequest

    offer = proposal.probe
    if offer is None or offer.status != "offered":
        raise Conflict(f"run {run.id}'s proposal offers no probe ({proposal.action}: {proposal.summary})",
                       proposal.action)
    runs.dry_run_restart(session, run.id, RestartRequest(**offer.restart))  # its checks, before anything stops
    spec = probes.with_steps(with_ttt(run.current.typed_spec, offer.ttt), offer.restart["overrides"]["max_steps"])
    previous, measured = run.attempt, pace.own_paces(run)
    try:
        attempt = restart_run(session, run, spec, False, f"probe taken{' (on_proposal: restart)' if auto else ''}: "
                              f"attempt {previous + 1} resumes the checkpoint at step {offer.from_step} at TTT="
                              f"{offer.ttt} for {offer.steps} steps", overrides=offer.restart["overrides"])
    except TransitionError as exc:
        raise Conflict(f"run {run.id} is {exc.current}; wait until it settles", exc.current) from None
    attempt.predicted_duration_seconds, attempt.prediction_basis = eta.predict_duration(
        measured, spec, done_steps=offer.from_step)
    wake_workers(session)
    taken = {**offer.model_dump(mode="json"), "status": "running", "attempt": run.attempt}
    text = (f"{'taken by on_proposal: restart' if auto else 'taken'}: the probe, attempt {run.attempt} at TTT="
            f"{offer.ttt} for {offer.steps} steps from attempt {previous}'s checkpoint; no further automatic restart")
    session.add(Event(run_id=run.id, kind="proposal", data={
        **event_data(proposal), "probe_taken": {**taken, "from_attempt": previous}, "auto": auto,
        "auto_restart": text, "restarted_to_attempt": run.attempt, "key": [*proposal.key, "probe", run.attempt]}))
    log.info("run %s: probe taken at TTT=%s for %s steps", run.id, offer.ttt, offer.steps)
    return attempt


def take_probe_by_hand(session: Session, run_id: str) -> Run:
    """POST /v1/runs/{id}/proposal/probe."""
    from server.queries import get_run

    run = get_run(session, run_id)
    take_probe(session, run, build(session, run))
    return run


def decide_probe(session: Session, run: Run, started: Event) -> str | None:
    """The probe's validation is in: price its draft against the running attempt's and continue the run as that
    says. Returns the decision, or None where the probe's sim acceptance is not in yet."""
    taken = started.data["probe_taken"]
    accs, _ = sim_metrics(run.latest or {})
    before = sim_acc_of(session, run.id, taken["from_attempt"])
    n = min(len(accs), len(before))
    if not n:
        return None
    ttt, trained = taken["ttt"], taken["trained_ttt"]
    now, probed = serving_speed(session, run, before[:n]), serving_speed(session, run, accs[:n])
    chosen, why = probes.verdict(now, probed, MIN_GAIN, ttt, trained)
    earlier = next(a for a in run.attempts if a.number == taken["from_attempt"])
    spec, overrides = probes.continuation(earlier.typed_spec, chosen)
    probe_attempt, measured = run.attempt, pace.own_paces(run)
    try:
        attempt = restart_run(session, run, spec, False, f"probe decided: {why}; attempt {probe_attempt + 1} "
                              f"continues at TTT={chosen} from the probe's checkpoint", overrides=overrides)
    except TransitionError:
        return None
    done = run.attempts[-2].last_step or 0 if len(run.attempts) > 1 else 0
    attempt.predicted_duration_seconds, attempt.prediction_basis = eta.predict_duration(measured, spec, done)
    wake_workers(session)
    decided = {**taken, "status": "decided", "attempt": probe_attempt, "decision": why}
    # shaped as a proposal event (its run, attempt, action and summary) for the stream's and webhooks' readers
    session.add(Event(run_id=run.id, kind="proposal", data={
        "run_id": run.id, "attempt": probe_attempt, "action": "restart" if chosen != trained else "keep_going",
        "summary": f"probe decided: {why}; attempt {run.attempt} continues at TTT={chosen}", "reason": why,
        "suggested_ttt": chosen if chosen != trained else None, "depth_after": None, "evidence": None,
        "trained_ttt": trained, "probe": decided, "probe_decided": decided, "continued_ttt": chosen,
        "restarted_to_attempt": run.attempt, "key": [probe_attempt, "probe_decided", chosen]}))
    log.info("run %s: probe decided, continuing at TTT=%s", run.id, chosen)
    return why


def after_validation(session: Session, run: Run) -> ProposalPublic | None:
    """Decide a probe whose validation is in; else store a `proposal` event if the proposal changed, and take it
    with on_proposal: restart where refusal_of finds nothing against it. Nothing for a run without `deploy`."""
    spec = run.current.typed_spec
    if spec.deploy is None:
        return None
    events = proposal_events(session, run.id)
    if (started := probes.running(events, run)) is not None:
        decide_probe(session, run, started)
        return None
    if run.status in TERMINAL:
        return None
    proposal = build(session, run)
    if proposal.action == "unavailable" and not proposal.sim_acc:
        return None
    take = False
    if proposal.action in ("restart", "probe") and spec.on_proposal == "restart" and proposal.suggested_ttt:
        refusal = refusal_of(session, run, proposal, events)
        proposal.auto_restart = f"refused: {refusal}" if refusal else ""
        take = refusal is None
    else:
        proposal.auto_restart = auto_restart_text(session, run, proposal, events)
    if not take and (not events or events[-1].data.get("key") != proposal.key):
        session.add(Event(run_id=run.id, kind="proposal", data=event_data(proposal)))
    if not take:
        return proposal
    if proposal.action == "probe":
        try:
            take_probe(session, run, proposal, auto=True)
        except (FieldError, Conflict, NotFound):
            pass
        return proposal
    previous, measured = run.attempt, pace.own_paces(run)
    try:
        attempt = restart_run(session, run, with_ttt(spec, proposal.suggested_ttt), True,
                              f"proposal taken (on_proposal: restart): attempt {previous + 1} at TTT="
                              f"{proposal.suggested_ttt}", overrides=proposal.restart["overrides"])
    except TransitionError:
        return proposal
    attempt.predicted_duration_seconds, attempt.prediction_basis = eta.predict_duration(measured, attempt.typed_spec)
    wake_workers(session)
    proposal.auto_restart = (f"taken by on_proposal: restart: attempt {previous} stopped, attempt {run.attempt} "
                             f"starts at TTT={proposal.suggested_ttt} (clean); no further automatic restart")
    session.add(Event(run_id=run.id, kind="proposal",
                      data={**event_data(proposal), "restarted_to_attempt": run.attempt, "auto": True,
                            "key": [*proposal.key, "restarted"]}))
    log.info("run %s: proposal taken, restarted at TTT=%s", run.id, proposal.suggested_ttt)
    return proposal


def after_validation_safely(session: Session, run: Run) -> None:
    """after_validation for the ingest path: a proposal that cannot be made never stops metrics being stored."""
    try:
        with session.begin_nested():
            after_validation(session, run)
    except Exception:  # noqa: BLE001 - the metrics are the job's; the proposal is advice about them
        log.exception("run %s: no proposal after this validation", run.id)
