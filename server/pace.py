"""Measured paces: what an attempt's steps took, and which earlier attempts resemble a new spec.

Plain functions over loaded rows; the one query that loads earlier attempts is queries.pace_history.
"""

import dataclasses
from dataclasses import dataclass

from server import eta
from server.models import Attempt, Run
from server.spec import RunCreate

STEP_FIXED_S, TTT_ITER_S = "step_fixed_s", "ttt_iter_s"  # trainer/step_timing.py's figures in a step line


@dataclass(frozen=True)
class PastAttempt:
    """An earlier attempt with a measured pace, and where it ran."""

    run_id: str
    hosts: list[str]
    measured: eta.Measured


def measured(a: Attempt) -> eta.Measured:
    """The attempt's pace; start-up and (for a finished attempt) wrap-up split from its step time."""
    startup = wrapup = 0.0
    if a.first_step_at and a.started_at:
        startup = max(0.0, (a.first_step_at - a.started_at).total_seconds() - a.sec_per_step)
        if a.status == "succeeded" and a.ended_at:  # all its steps ran: the rest of its time is the wrap-up
            taken = (a.ended_at - a.started_at).total_seconds()
            wrapup = max(0.0, taken - startup - a.total_steps * a.sec_per_step)
    return eta.Measured(a.typed_spec, a.sec_per_step, a.total_steps, startup, wrapup)


def own_paces(run: Run) -> list[eta.Measured]:
    """This run's attempts with a measured pace, newest first; the current one with the trainer's split of its
    compiled steps where its metric lines carry one (run.latest: step_fixed_s, ttt_iter_s)."""
    out = [measured(a) for a in sorted(run.attempts, key=lambda a: -a.number) if a.sec_per_step and a.total_steps]
    latest = run.latest or {}
    fixed, iteration = latest.get(STEP_FIXED_S), latest.get(TTT_ITER_S)
    if out and run.current.sec_per_step and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
                                                for v in (fixed, iteration)) and iteration > 0:
        out[0] = dataclasses.replace(out[0], step_fixed_s=float(fixed), ttt_iter_s=float(iteration))
    return out


def similar_paces(history: list[PastAttempt], spec: RunCreate, exclude_run: str | None = None) -> list[eta.Measured]:
    """Earlier attempts on the same hosts with the same program and process count, newest first."""
    hosts = spec.host_names
    out = []
    for past in history:
        s = past.measured.spec
        if past.run_id == exclude_run or past.hosts != hosts:
            continue
        same_program = s.entrypoint == spec.entrypoint and (s.trainer is None) == (spec.trainer is None)
        if same_program and s.nproc_per_node == spec.nproc_per_node:
            out.append(past.measured)
    return out


def wrapup_seconds(run: Run, history: list[PastAttempt]) -> float:
    """What the run's attempt will take after its last step (final validation, evaluation, export): as the newest
    finished attempt of its own took it, else a similar earlier one in `history` (when loaded), else 0."""
    found = [m for m in own_paces(run) if m.wrapup_seconds]
    found = found or [m for m in similar_paces(history, run.typed_spec, exclude_run=run.id) if m.wrapup_seconds]
    return found[0].wrapup_seconds if found else 0.0


def paces(run: Run, history: list[PastAttempt]) -> list[eta.Measured]:
    """The run's own measured attempts; without any, similar earlier ones from `history`."""
    return own_paces(run) or similar_paces(history, run.typed_spec, exclude_run=run.id)
