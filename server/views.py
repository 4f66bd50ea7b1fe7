"""Response building: ORM rows (loaded by the caller) into the API's schemas. Runs no query."""

from pydantic import ValidationError

from server import eta, hosts, pace
from server.db import WriteFailure
from server.errors import Conflict
from server.lifecycle import TERMINAL, RunStatus, expected_start, total_note
from server.log_patterns import NO_TOTAL_NOTE
from server.models import Attempt, Host, Run, utcnow
from server.schemas import (
    AttemptEvaluation,
    AttemptPublic,
    GpuSnapshotPublic,
    HostPublic,
    InputBoundPublic,
    InterconnectPublic,
    RunPublic,
    VerifierProbePublic,
    without_env_values,
)
from server.spec import RunCreate
from trainer import series as trainer_series


def attempt_public(a: Attempt) -> AttemptPublic:
    actual = None
    error = None
    if a.ended_at and a.started_at:
        actual = (a.ended_at - a.started_at).total_seconds()
        if a.predicted_duration_seconds and a.status == "succeeded":
            error = (actual - a.predicted_duration_seconds) / a.predicted_duration_seconds
    return AttemptPublic(number=a.number, spec=without_env_values(a.spec), status=a.status, created_at=a.created_at,
                         started_at=a.started_at, first_step_at=a.first_step_at, ended_at=a.ended_at,
                         exit_code=a.exit_code, message=a.message, log_path=a.log_path, nodes=a.nodes,
                         last_step=a.last_step, total_steps=a.total_steps, seconds_per_step=a.sec_per_step,
                         predicted_duration_seconds=a.predicted_duration_seconds,
                         actual_duration_seconds=actual, prediction_error=error, metrics_skipped=a.metrics_skipped or 0)


def needs_pace_history(run: Run) -> bool:
    """Whether the run's ETA needs other runs' attempts: active, and none of its own measured, or none of its own
    finished to say how long the wrap-up after the last step takes (pace.wrapup_seconds)."""
    if run.status in TERMINAL:
        return False
    own = pace.own_paces(run)
    return (run.current.sec_per_step is None and not own) or not any(m.wrapup_seconds for m in own)


def progress_and_eta(run: Run, history: list[pace.PastAttempt]) -> tuple[float | None, float | None]:
    """Progress from the latest step; the ETA from the measured pace, else from earlier attempts in `history`."""
    a = run.current
    progress = None
    if a.total_steps and a.last_step is not None:
        progress = min(1.0, a.last_step / a.total_steps)
    if run.status == RunStatus.SUCCEEDED:
        return 1.0, 0.0
    if run.status in TERMINAL:
        return progress, None
    if a.sec_per_step is not None:
        # the server's clock on both sides: a job's clock an hour off must not move the ETA
        since = (utcnow() - a.step_seen_at).total_seconds() if a.step_seen_at else 0.0
        return progress, eta.remaining_seconds(a.total_steps, a.last_step, a.sec_per_step, since,
                                               pace.wrapup_seconds(run, history))
    seconds, _ = eta.predict_duration(pace.paces(run, history), a.typed_spec)
    start = expected_start(a)
    if seconds is not None and start is not None:
        # a batch job still in its scheduler's queue: the ETA counts from when it is expected to start
        seconds += max(0.0, (start - utcnow()).total_seconds())
    return progress, seconds


def progress_note(spec: RunCreate, total_steps: int | None, active: bool, found: str | None = None) -> str | None:
    """What a run's answer says about its progress: for an entrypoint run, how its total was found from what its
    host read (`found`), or, while it is unknown, how to give one."""
    if found and total_steps:
        return found
    if spec.trainer is not None or total_steps or not active or spec.stated_total_steps:
        return None
    return NO_TOTAL_NOTE


def run_message(run: Run, write_failure: WriteFailure | None) -> str | None:
    """The run's message; while the store refuses writes, an active run's says so first (its state is behind)."""
    if write_failure is None or run.status in TERMINAL:
        return run.message
    said = (f"the server cannot store this run's progress since {write_failure.since:%Y-%m-%d %H:%M:%S} UTC "
            f"({write_failure.error}); the job goes on, and the run is brought up to date, its outcome included, "
            f"once the store takes writes again")
    return f"{said}. {run.message}" if run.message else said


def _figure(latest: dict, name: str) -> float | None:
    value = latest.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def input_bound_public(latest: dict) -> InputBoundPublic | None:
    """What the answer says when the trainer's latest steps waited for data (`input_bound`) a tenth of their time
    or more: the share, the wait against the step, and that the reads are the bound."""
    share = _figure(latest, trainer_series.INPUT_BOUND)
    if share is None or share < trainer_series.INPUT_BOUND_NOTICE:
        return None
    wait, step = _figure(latest, trainer_series.DATA_WAIT_S), _figure(latest, trainer_series.STEP_TIME_S)
    figures = f" ({wait * 1e3:.0f} of {step * 1e3:.0f} ms)" if wait is not None and step else ""
    return InputBoundPublic(share=share, data_wait_s=wait, step_time_s=step,
                            note=f"input-bound: {share:.0%} of each step waits for data{figures}; reads are the "
                                 "bound: store the features in FP8 (prepare --store-dtype fp8) or give more readers "
                                 "(trainer num_workers)")


def run_public(run: Run, history: list[pace.PastAttempt], write_failure: WriteFailure | None = None) -> RunPublic:
    """The run as clients see it; `history` is queries.pace_history_for([run]) (empty when not needed), and
    `write_failure` the store's (a read session's info), said in the message of an active run."""
    progress, eta_seconds = progress_and_eta(run, history)
    return RunPublic(id=run.id, name=run.name, status=run.status, message=run_message(run, write_failure),
                     attempt=run.attempt,
                     hosts=run.hosts, spec=without_env_values(run.spec), progress=progress, eta_seconds=eta_seconds,
                     progress_note=progress_note(run.typed_spec, run.current.total_steps, run.status not in TERMINAL,
                                                   total_note(run.current)),
                     host_reachable=run.host_reachable, latest=run.latest or {},
                     input_bound=input_bound_public(run.latest or {}), created_at=run.created_at,
                     updated_at=run.updated_at, ended_at=run.ended_at,
                     attempts=[attempt_public(a) for a in run.attempts])


def evaluations(run: Run) -> list[AttemptEvaluation]:
    """Every attempt's acceptance report, oldest first; Conflict when a job reported one of another shape."""
    reports = []
    for a in run.attempts:
        if a.evaluation:
            try:
                reports.append(AttemptEvaluation.model_validate(
                    {**a.evaluation, "attempt": a.number, "ttt_steps": eta.ttt_of(a.typed_spec)}))
            except ValidationError as exc:
                raise Conflict(f"attempt {a.number} reported an evaluation that is not an acceptance report "
                               f"(see python -m trainer.evaluate): {exc.errors()[0]['msg']} at "
                               f"{'.'.join(map(str, exc.errors()[0]['loc']))}") from None
    return reports


def host_public(host: Host) -> HostPublic:
    return HostPublic(name=host.name, kind=host.kind, address=host.address, port=host.port, username=host.username,
                      workspace=host.workspace, workspace_real=host.workspace_real, python=host.python, reachable=host.reachable,
                      reached=host.reached, last_seen_at=host.last_seen_at, last_error=host.last_error, gpus=host.gpu_snapshot,
                      gpus_sampled_at=host.gpu_snapshot_at)


def interconnect_public(host: Host) -> InterconnectPublic:
    measured = host.interconnect or {}
    wanted = host.interconnect_wanted_tp
    return InterconnectPublic(host=host.name, status=hosts.interconnect_status(host), requested_tp=wanted or None,
                              message=host.interconnect_error, **measured)


def verifier_probe_public(host: Host) -> VerifierProbePublic:
    measured = (host.interconnect or {}).get("verifier") or {}
    shown = {k: measured.get(k) for k in ("path", "tp", "ep", "gpu", "dtype", "measured_at")}
    return VerifierProbePublic(host=host.name, status=hosts.verifier_status(host), requested=host.verifier_wanted,
                               message=host.verifier_error, dense_ms=measured.get("dense_ms") or [],
                               moe_ms=measured.get("moe_ms") or [], **shown)


def gpu_snapshot_public(host: Host) -> GpuSnapshotPublic:
    return GpuSnapshotPublic(host=host.name, sampled_at=host.gpu_snapshot_at, reachable=host.reachable,
                             **host.gpu_snapshot)
