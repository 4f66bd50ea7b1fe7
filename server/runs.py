"""Run commands: what changes a run (submit, cancel, restart), each inside the caller's transaction.

The worker imports none of this (it changes runs through server/lifecycle.py); reads live in server/queries.py.
"""

import hashlib
import json
import uuid
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from server import eta, queries, resume
from server import hosts as hosts_domain
from server.errors import Conflict, FieldError
from server.layout import HostLayout
from server.lifecycle import (
    TERMINAL,
    RunStatus,
    TransitionError,
    open_attempt,
    queue_new_run,
    restart_run,
    transition,
)
from server.models import Attempt, Event, Host, LogChunk, MetricPoint, Run, utcnow
from server.queries import get_run
from server.schemas import DryRunPublic, RestartOverrides, RestartRequest
from server.spec import (
    RunCreate,
    is_inside,
    normalized_path,
    spec_dict,
    without_env_values,
)
from server.wakeup import wake_workers

# what of a spec travels to the host in the launch request, and the bound on its JSON: the launch goes as one
# argument of a command, which Linux caps at 128 KiB (MAX_ARG_STRLEN); the rest is the token, paths and torchrun's
LAUNCHED_FIELDS = ("args", "env", "trainer", "entrypoint", "cwd", "slurm")
MAX_LAUNCH_BYTES = 96 * 1024


def _check_launch_size(body: dict[str, Any], loc: tuple[str, ...] = ()) -> None:
    """Refuse a spec whose launch would not fit, naming its largest field, rather than one stuck launching."""
    sizes = {f: len(json.dumps(body[f])) for f in LAUNCHED_FIELDS if f in body}
    if sum(sizes.values()) > MAX_LAUNCH_BYTES:
        largest = max(sizes, key=lambda f: sizes[f])
        raise FieldError((*loc, largest), f"the launch would carry {sum(sizes.values())} bytes of JSON (at most "
                         f"{MAX_LAUNCH_BYTES}); `{largest}` alone is {sizes[largest]}: pass large data as a file")


def _check_hosts(session: Session, spec: RunCreate) -> list[Host]:
    names = spec.host_names
    field = "host" if spec.host is not None else "hosts"
    hosts = {h.name: h for h in session.scalars(select(Host).where(Host.name.in_(names)))}
    for i, name in enumerate(names):
        if name not in hosts:
            loc = (field,) if field == "host" else (field, i)
            raise FieldError(loc, hosts_domain.unknown_host(name), name)
    if len(set(names)) != len(names):
        raise FieldError(("hosts",), "a host may appear only once in `hosts`", names)
    return [hosts[n] for n in names]


def _check_deploy(session: Session, spec: RunCreate) -> None:
    """A `deploy` is priced on its host's all-reduce table at its tp: a host without one at that tp is refused at
    submit, naming the probe that measures it, rather than found at the first validation."""
    deploy = spec.deploy
    if deploy is None or deploy.tp == 1:
        return
    command = f"`longrun hosts probe-interconnect {deploy.host} --tp {deploy.tp or 'N'}`"
    host = session.scalar(select(Host).where(Host.name == deploy.host))
    if host is None:
        raise FieldError(("deploy", "host"), f"unknown host {deploy.host!r}: register it with POST /v1/hosts, then "
                         f"measure its all-reduce with {command}", deploy.host)
    measured = host.interconnect or {}
    if "allreduce" not in measured:
        raise FieldError(("deploy", "host"), f"{deploy.host} has no measured all-reduce table to price the "
                         f"deployment on: {command} measures it", deploy.host)
    if deploy.tp is not None and deploy.tp != measured.get("tp"):
        raise FieldError(("deploy", "tp"), f"{deploy.host}'s all-reduce was measured at tp={measured.get('tp')}, "
                         f"not {deploy.tp}: {command} measures it there", deploy.tp)


def _check_scheduler(spec: RunCreate, hosts: list[Host], loc: tuple[str, ...] = ()) -> None:
    """A run on a Slurm host names that one host (its nodes are `slurm.nodes`); `slurm` goes only with one."""
    slurm_hosts = [h.name for h in hosts if h.kind == "slurm"]
    if slurm_hosts and len(hosts) > 1:
        raise FieldError((*loc, "hosts"), f"{slurm_hosts[0]} is a Slurm host: give it alone as `host`, and the "
                         "number of nodes as `slurm.nodes`", spec.host_names)
    if spec.slurm is not None and not slurm_hosts:
        raise FieldError((*loc, "slurm"), f"host {hosts[0].name} is not of kind `slurm`: its runs start directly "
                         "on it, without a batch job")


# the trainer's inputs, checked on the host at submit (what the trainer reads before its first step)
INPUT_FIELDS = ("verifier_path", "data_dir", "vocab_mapping_dir", "eval_corpus", "init_from")


def input_paths(spec: RunCreate) -> dict[tuple[str, ...], str]:
    """The trainer's input paths by field (loc), for the host to say whether they are there."""
    if spec.trainer is None:
        return {}
    return {("trainer", f): path for f in INPUT_FIELDS if isinstance(path := getattr(spec.trainer, f, None), str)}


def refuse_missing_inputs(spec: RunCreate, host: str, found: dict[str, str | None]) -> None:
    """A 422 naming the first input field whose path the host says is not there, and what makes it."""
    for loc, path in input_paths(spec).items():
        if path in found and found[path] is None:
            raise FieldError(loc, f"{path} is not on host {host} (looked for there just now): "
                             f"{_what_makes(loc[-1], path)}", path)


def _what_makes(field: str, path: str) -> str:
    if "/.demo/" in path:
        return "`make demo-quick` (or `make demo`) prepares .demo/verifier and .demo/data in the clone"
    if field in ("data_dir", "vocab_mapping_dir"):
        return ("`python -m trainer.prepare --verifier-path V --corpus FILE --output-dir D` writes D/hidden_states "
                "and D/vocab_mapping there; or fix the path in the spec")
    return ("fix the path in the spec, or copy it there (a spec file's relative paths are resolved by `longrun "
            "submit`: beside the file on `local`, under the host's workspace elsewhere)")


# a suffixed name tries NAME-2, NAME-3, ... this far before giving up (each a name some run already has)
MAX_NAME_SUFFIX = 1000
# the advisory lock that serialises submits on PostgreSQL: a fixed 63-bit number of our own
NAMES_LOCK_KEY = int.from_bytes(hashlib.sha256(b"longrun run names").digest()[:8], "big") >> 1


def _live_named(session: Session, name: str) -> Run | None:
    """The newest run of that name that has not ended."""
    return session.scalars(select(Run).where(Run.name == name, Run.status.not_in(TERMINAL))
                           .order_by(Run.created_at.desc()).limit(1)).first()


def _lock_names(session: Session) -> None:
    """Serialise submits on PostgreSQL (SQLite's write transaction already is): two submits of one name at once must
    not both find it free. A transaction-scoped advisory lock, as dstack takes one around its run names."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": NAMES_LOCK_KEY})


def _run_name(session: Session, name: str, suffix: bool) -> str:
    """The name the new run gets. A name is unique among live runs (as a dstack run name or a SkyPilot cluster name
    is): a second submit of a live name is refused, naming the live run, unless `suffix` asks for the first free
    NAME-N instead (free among every run, ended ones too, so that the new name names one run only)."""
    live = _live_named(session, name)
    if live is None:
        return name
    if not suffix:
        raise Conflict(f"a run named {name!r} is live: {live.id} ({live.status}, attempt {live.attempt}); follow it "
                       f"with `longrun watch {live.id}`, cancel it first (`longrun cancel {live.id}`), or submit with "
                       f"--name-suffix (POST /v1/runs?name_suffix=true) to start another beside it as {name}-N",
                       live.status)
    base = name[:255 - 1 - len(str(MAX_NAME_SUFFIX))]
    taken = set(session.scalars(select(Run.name).where(Run.name.startswith(f"{base}-", autoescape=True))))
    for n in range(2, MAX_NAME_SUFFIX + 1):
        if f"{base}-{n}" not in taken:
            return f"{base}-{n}"
    raise Conflict(f"{name}-2 to {name}-{MAX_NAME_SUFFIX} are all taken: give the run a name of its own", live.status)


def _checkpoint_left(session: Session, spec: RunCreate) -> tuple[Run, int, int | None] | None:
    """(the run, its checkpoint's step, that step's TTT depth) of the newest checkpoint another run's trainer left in
    this spec's output directory on one of its hosts, as the attempts' measured steps tell it (server/resume.py)."""
    trainer = spec.trainer
    if trainer is None:
        return None
    found: tuple[Run, int, int | None] | None = None
    hosts = set(spec.host_names)
    attempts = session.scalars(select(Attempt).where(Attempt.last_step > 0).order_by(Attempt.created_at))
    for attempt in attempts:
        past = attempt.typed_spec
        if (past.trainer is None or normalized_path(past.trainer.output_dir) != normalized_path(trainer.output_dir)
                or not hosts & set(past.host_names)):
            continue
        step = resume.checkpoint_step(past, attempt.last_step, attempt.total_steps)
        if step:
            found = (session.get(Run, attempt.run_id), step, past.trainer.ttt_steps)
    return found


def _check_start(session: Session, spec: RunCreate, hosts: list[Host], start: str | None) -> None:
    """A trainer run whose output directory holds another run's checkpoint would quietly continue it (the trainer
    resumes the newest checkpoint in its output directory): refused unless the request says where it starts
    (`start`: resume it, or fresh, which empties the directory first) or the spec does (`trainer.no_resume`)."""
    if spec.trainer is None:
        return
    target = spec.trainer.output_dir
    if start == "fresh":
        for host in hosts:
            if normalized_path(host.workspace) == "/" or not is_inside(target, host.workspace):
                raise FieldError(("trainer", "output_dir"), f"start=fresh empties {target}, which is outside the "
                                 f"workspace {host.workspace} of host {host.name}: give an output_dir inside it", target)
        return
    if start == "resume" or spec.trainer.no_resume is not None:
        return
    left = _checkpoint_left(session, spec)
    if left is None:
        return
    run, step, ttt = left
    depth = f", trained with {ttt} TTT steps" if ttt else ""
    raise FieldError(("trainer", "output_dir"), f"{target} holds the checkpoint at step {step} of run {run.name} "
                     f"({run.id}, {run.status}){depth}: this run would continue it, not train from step 0. Say which: "
                     f"continue from it (longrun submit SPEC --start resume; API ?start=resume), or start fresh, "
                     f"emptying it first (longrun submit SPEC --start fresh; API ?start=fresh), or give another "
                     f"output_dir", target)


def submit_run(session: Session, spec: RunCreate, idempotency_key: str | None = None,
               name_suffix: bool = False, start: str | None = None) -> tuple[Run, bool]:
    """Create a queued run; with an idempotency key a repeat of the same request returns the first run. A name a
    live run has is refused (Conflict), or with `name_suffix` made NAME-N (_run_name). A trainer run over another
    run's checkpoint says where it starts (`start`: "resume" or "fresh", or the spec's `trainer.no_resume`)."""
    body = spec_dict(spec)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    _lock_names(session)  # first: a repeat sent while the first is being written finds it once it is
    if idempotency_key:
        existing = session.scalar(select(Run).where(Run.idempotency_key == idempotency_key))
        if existing is not None:
            if existing.request_hash != digest:
                raise Conflict(f"Idempotency-Key {idempotency_key!r} was used for a different request")
            return get_run(session, existing.id), False
    hosts = _check_hosts(session, spec)
    _check_scheduler(spec, hosts)
    _check_launch_size(body)
    _check_deploy(session, spec)
    _check_start(session, spec, hosts, start)
    name = _run_name(session, spec.name, name_suffix)
    if name != spec.name:
        spec = spec.model_copy(update={"name": name})
        body = {**body, "name": name}
    run = Run(id=uuid.uuid4().hex[:12], name=name, spec=body,
              hosts=spec.host_names, max_retries=spec.max_retries, idempotency_key=idempotency_key,
              request_hash=digest, latest={}, attempts=[])
    run.clean_pending = start == "fresh" and spec.trainer is not None  # the worker empties it before the launch
    session.add(run)
    open_attempt(session, run, body, 1)
    queue_new_run(session, run)
    wake_workers(session)
    return run, True


def request_cancel(session: Session, run_id: str) -> Run:
    run = get_run(session, run_id)
    try:
        transition(session, run, RunStatus.CANCELLING, "cancel requested")
    except TransitionError as exc:
        raise Conflict(f"run {run_id} is {exc.current}: only a queued, launching or running run can be "
                       f"cancelled", exc.current) from None
    wake_workers(session)
    return run


def delete_run(session: Session, run_id: str) -> None:
    """Forget an ended run: its attempts, metrics, logs and events go from the database; the files its attempts
    left on the host stay (`<workspace>/.longrun/<run id>/`). Refused while it has not ended, and while the
    worker still has to stop something of it left on a host that was away."""
    run = get_run(session, run_id)
    if run.status not in TERMINAL:
        raise Conflict(f"run {run_id} is {run.status}: only an ended run can be deleted; cancel it first "
                       f"(`longrun cancel {run_id}`)", run.status)
    if any(a.abandoned for a in run.attempts):
        raise Conflict(f"run {run_id} has an attempt still to be stopped on a host that was away: delete it once "
                       "the worker has stopped it", run.status)
    for table in (MetricPoint, LogChunk, Event):
        session.execute(delete(table).where(table.run_id == run.id))
    session.delete(run)


def apply_overrides(current: RunCreate, overrides: RestartOverrides) -> RunCreate:
    """The current spec with `overrides` (each checked as its field already) applied and the whole checked again
    (the rules between fields); a trainer field for a run without `trainer`, or a rule the result breaks, is a
    field error naming the override."""
    trainer = overrides.trainer()
    if trainer and current.trainer is None:
        key = min(trainer)
        raise FieldError(("overrides", key), f"{key!r} is a trainer field, but this run has no `trainer`")
    fields = {**dict(current), **overrides.top_level()}
    if current.trainer is not None:
        fields["trainer"] = {**dict(current.trainer), **trainer}
    try:
        return RunCreate.model_validate(fields)
    except ValidationError as exc:
        # an override names a trainer field without its `trainer.` prefix, so its errors do too
        raise FieldError.from_validation(exc, under=("overrides",), strip=("trainer",)) from None


def _restart_spec(session: Session, run: Run, req: RestartRequest) -> RunCreate:
    spec = apply_overrides(run.typed_spec, req.overrides)
    if req.init_from_last:
        if spec.trainer is None:
            raise FieldError(("init_from_last",), "only trainer runs can start from the last draft")
        previous = run.typed_spec.trainer.output_dir
        if req.clean and spec.trainer.output_dir == previous:
            # the clean would delete it: the worker moves the draft here first (hostside clean keep_into)
            host = _check_hosts(session, spec)[0]
            previous = HostLayout(host.workspace).draft_stash(run.id, run.attempt + 1)
        spec.trainer.init_from = previous
    elif spec.trainer and spec.trainer.init_from and any(
            HostLayout(h.workspace).holds_records_of(spec.trainer.init_from, run.id) for h in _check_hosts(session, spec)):
        spec.trainer.init_from = None  # a stash from an earlier warm restart is not this restart's start
    if req.clean:
        target = spec.clean_dir
        if target is None:
            raise FieldError(("clean",), "clean needs an `output_dir` (trainer.output_dir for trainer runs)")
        for host in _check_hosts(session, spec):
            # a workspace registered before `//` was refused may still spell `/`: nothing is inside it
            if normalized_path(host.workspace) == "/" or not is_inside(target, host.workspace):
                fix = (f"restart into a directory inside it (longrun restart {run.name} --set output_dir="
                       f"{host.workspace.rstrip('/')}/{run.name} --start fresh)" if spec.trainer else
                       "submit the run again with an output_dir inside it")
                raise FieldError(("clean",), f"refusing to clean {target}: it is outside the workspace "
                                 f"{host.workspace} of host {host.name}; {fix}", target)
    _check_scheduler(spec, _check_hosts(session, spec), ("overrides",))
    _check_launch_size(spec_dict(spec), ("overrides",))
    return spec


def request_restart(session: Session, run_id: str, req: RestartRequest) -> Run:
    run = get_run(session, run_id)
    spec = _restart_spec(session, run, req)
    measured = queries.measured_attempts(session, run)
    plan = resume.start_plan(run, spec, req.clean, req.resume)  # before the new attempt joins the run
    try:
        attempt = restart_run(session, run, spec, req.clean, f"restart requested: attempt {run.attempt + 1}"
                              f" ({plan.why})", overrides=without_env_values(req.overrides.given()))
    except TransitionError as exc:
        raise Conflict(f"run {run_id} is {exc.current}; wait until it settles, then restart", exc.current) from None
    predicted, basis = eta.predict_duration(measured, spec, done_steps=plan.from_step or 0)
    attempt.predicted_duration_seconds, attempt.prediction_basis = predicted, basis
    wake_workers(session)
    return run


def dry_run_restart(session: Session, run_id: str, req: RestartRequest) -> DryRunPublic:
    """What a restart would do, changing nothing: the new spec and its predicted duration."""
    run = get_run(session, run_id)
    spec = _restart_spec(session, run, req)
    if run.status in (RunStatus.RESTARTING, RunStatus.CANCELLING):
        raise Conflict(f"run {run_id} is {run.status}; wait until it settles, then restart", run.status)
    plan = resume.start_plan(run, spec, req.clean, req.resume)
    seconds, basis = eta.predict_duration(queries.measured_attempts(session, run), spec, done_steps=plan.from_step or 0)
    finish = utcnow() + timedelta(seconds=seconds) if seconds is not None else None
    return DryRunPublic(new_spec=without_env_values(spec_dict(spec)), predicted_duration_seconds=seconds, predicted_finish=finish,
                        basis=basis, start=plan.start, resumes_from_step=plan.from_step,
                        resumes_ttt_steps=plan.trained_ttt, start_reason=plan.why)
