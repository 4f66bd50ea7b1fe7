"""The measurement that settles a depth proposal the evidence cannot decide: a short probe.

Where the retrain rule's record does not trust its own prediction for this restart (rule_record.judge), or the
evidence's intervals hold both verdicts, the proposal offers one action instead of a bare "cannot tell": resume the
current checkpoint at the candidate TTT for N steps (`trainer.max_steps` = the checkpoint's step + N, `resume`
across the depth change: server/resume.py), whose end runs the trainer's validation; then read the probe's sim
acceptance at every position, the deep ones included, against the running attempt's last validation, price both on
the deployment (the same cost model), and decide:

- the probe's draft serves at least MIN_GAIN faster: the run continues at the candidate TTT from the probe's
  checkpoint, for the steps the run had left (its own max_steps again);
- else: the run continues at its trained TTT from that checkpoint (the probe's N steps are kept: the draft's
  architecture does not depend on the TTT depth).

Measured, not predicted: the probe's acceptance is a draft trained N steps at the deeper TTT, a lower bound on
what a whole attempt there reaches. N, the probe's wall time and GPU-hours (the restart dry run's, server/eta.py)
are stated before it runs. POST /v1/runs/{id}/proposal/probe takes it; `on_proposal: restart` takes it by
itself. The decision is a `proposal` event (`probe_decided`), and the restart it makes says why.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from server import eta
from server.models import Event, Run
from server.resume import start_plan
from server.retrain_time import with_ttt
from server.spec import RunCreate

# the probe's steps: enough for the deeper objective to move the positions past the trained depth, a small share
# of the run (the trainer validates at the probe's end)
PROBE_MIN_STEPS = 200
PROBE_SHARE = 0.05


class ProbePublic(BaseModel):
    """The probe offered (or running, or decided): what it runs, what it costs, how it decides."""

    ttt: int = Field(description="the candidate TTT the probe trains at")
    trained_ttt: int
    steps: int = Field(description="N: the steps it trains at the candidate TTT from the checkpoint")
    from_step: int = Field(description="the checkpoint it resumes (0: none yet, it trains from the start)")
    predicted_seconds: float | None = Field(None, description="its wall time, the restart dry run's")
    gpu_hours: float | None = Field(None, description="predicted_seconds x the GPUs the run trains on")
    basis: str = Field("", description="what the prediction rests on")
    restart: dict[str, Any] = Field(description="the restart it runs (POST /v1/runs/{id}/restart's body)")
    take: str = Field(description="how to take it: the request, or the CLI command")
    decides: str = Field(description="how its result decides, and what the run does then")
    status: Literal["offered", "running", "decided"] = "offered"
    attempt: int | None = Field(None, description="the probe's attempt, once taken")
    decision: str | None = Field(None, description="once decided: the verdict and its figures")


def steps_for(total_steps: int | None) -> int:
    return max(PROBE_MIN_STEPS, round(PROBE_SHARE * (total_steps or 0)))


def plan(run: Run, spec: RunCreate, measured: list[eta.Measured], ttt: int, trained: int,
         min_gain: float) -> ProbePublic:
    """The probe of a restart from `trained` to `ttt`, priced before it runs."""
    steps = steps_for(run.current.total_steps)
    start = start_plan(run, with_ttt(spec, ttt), clean=False, resume=True)
    from_step = start.from_step or 0
    probe_spec = with_steps(with_ttt(spec, ttt), from_step + steps)
    seconds, basis = eta.predict_duration(measured, probe_spec, done_steps=from_step)
    restart = {"overrides": {"ttt_steps": ttt, "max_steps": from_step + steps}, "resume": True}
    return ProbePublic(
        ttt=ttt, trained_ttt=trained, steps=steps, from_step=from_step, predicted_seconds=seconds,
        gpu_hours=seconds * spec.gpus / 3600 if seconds is not None else None, basis=basis, restart=restart,
        take=f"POST /v1/runs/{run.id}/proposal/probe, or `longrun advise {run.id} --probe`",
        decides=(f"at the probe's validation, its sim acceptance at positions 1..{ttt} and beyond against this "
                 f"attempt's last, both priced on the deployment: at least {min_gain:.0%} faster continues the run "
                 f"at TTT={ttt} from the probe's checkpoint, else at TTT={trained}; the run's own max_steps again"))


def describe(probe: ProbePublic) -> str:
    seconds = probe.predicted_seconds or 0.0
    wall = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    cost = (f"about {wall}, {probe.gpu_hours:.3g} GPU-h"
            if probe.predicted_seconds is not None and probe.gpu_hours is not None else "its time unknown yet")
    return (f"probe TTT={probe.ttt}: resume the checkpoint at step {probe.from_step} at TTT={probe.ttt} for "
            f"{probe.steps} steps ({cost}), then decide on measured acceptance ({probe.take})")


def with_steps(spec: RunCreate, max_steps: int | None) -> RunCreate:
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"max_steps": max_steps})})


def running(events: list[Event], run: Run) -> Event | None:
    """The event that started the probe the run's current attempt is, if it is one and is not decided yet."""
    for e in reversed(events):
        if e.data.get("probe_decided"):
            return None
        probe = e.data.get("probe_taken")
        if isinstance(probe, dict) and probe.get("attempt") == run.attempt:
            return e
    return None


def continuation(before: RunCreate, ttt: int) -> tuple[RunCreate, dict[str, Any]]:
    """The spec the run continues with after a probe (the attempt before it, at `ttt`), and the overrides that
    name the change."""
    spec = with_steps(with_ttt(before, ttt), before.trainer.max_steps)
    return spec, {"ttt_steps": ttt, "max_steps": before.trainer.max_steps}


def verdict(tps_running: float, tps_probe: float, min_gain: float, ttt: int, trained: int) -> tuple[int, str]:
    """(the TTT the run continues at, why), from the two drafts' tokens/s on the deployment."""
    gain = tps_probe / tps_running - 1 if tps_running > 0 else 0.0
    figures = (f"the probe's draft (TTT={ttt}) serves {tps_probe:.1f} tokens/s against {tps_running:.1f} for the "
               f"running attempt's (TTT={trained}), {gain:+.1%}, both from measured sim acceptance")
    if gain >= min_gain:
        return ttt, f"restart at TTT={ttt}: {figures}, at least the {min_gain:.0%} worth it"
    return trained, f"keep going at TTT={trained}: {figures}, below the {min_gain:.0%} worth a deeper TTT"
