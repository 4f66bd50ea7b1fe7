"""The host protocol: one request and one answer type per verb of the host agent (worker/hostside/).

On the wire each request is a JSON object (`to_wire`) and each answer one JSON line, read back with
`from_wire`; the field names are the agent's. An answer is untrusted input: `from_wire` checks every
field's type and raises TypeError, ValueError or KeyError on another shape (HostAgent names the verb). worker/host_agent.py sends them over a transport;
tests/worker/fake_host.py answers them from an in-memory host.
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from server.lifecycle import NodeState
from worker.gpus import GpuSnapshot, attach_users, snapshot_from_outputs
from worker.hostside.files import READ_LIMIT


def _typed(raw: dict[str, Any], name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """raw[name], checked to be of `kind` (None allowed when optional); bool is never taken for an int."""
    value = raw.get(name) if optional else raw[name]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise TypeError(f"{name} is {type(value).__name__}, not {getattr(kind, '__name__', kind)}")
    return value


def _pids(raw: dict[str, Any], name: str, optional: bool = False) -> list[int]:
    values = _typed(raw, name, list, optional) or []
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in values):
        raise TypeError(f"{name} holds something other than pids")
    return list(values)


def _object(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
    return raw


@dataclass(frozen=True)
class GpuView:
    """A GPU snapshot plus which of its processes carry which attempt token."""

    snapshot: GpuSnapshot
    token_of: dict[int, str]

    def pids_of(self, tokens: set[str]) -> set[int]:
        return {pid for pid, token in self.token_of.items() if token in tokens}


@dataclass(frozen=True)
class GpuQuery:
    """Ask for nvidia-smi's two answers (the agent runs its own QUERY_GPU_CMD and QUERY_APPS_CMD) and which process
    carries which of `tokens`."""

    tokens: list[str]


@dataclass(frozen=True)
class CommandOutput:
    rc: int
    stdout: str
    stderr: str

    @classmethod
    def from_wire(cls, raw: Any) -> "CommandOutput":
        raw = _object(raw)
        return cls(_typed(raw, "rc", int), _typed(raw, "stdout", str), _typed(raw, "stderr", str))


@dataclass(frozen=True)
class GpuOwner:
    user: str | None
    token: str | None


@dataclass(frozen=True)
class GpusAnswer:
    gpu: CommandOutput
    apps: CommandOutput
    owners: dict[int, GpuOwner]

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "GpusAnswer":
        owners = _typed(raw, "owners", dict, optional=True) or {}
        return cls(CommandOutput.from_wire(raw["gpu"]), CommandOutput.from_wire(raw["apps"]),
                   {int(pid): GpuOwner(_typed(_object(o), "user", str, True), _typed(o, "token", str, True))
                    for pid, o in owners.items()})

    def view(self) -> GpuView:
        g, a = self.gpu, self.apps
        snapshot = snapshot_from_outputs(g.rc, g.stdout, a.stdout, g.stderr + a.stderr, apps_rc=a.rc)
        attach_users(snapshot, {pid: o.user for pid, o in self.owners.items()})
        return GpuView(snapshot, {pid: o.token for pid, o in self.owners.items() if o.token})


class Request:
    """A verb's request; `answer` is the type its answer is read as."""

    verb: ClassVar[str]
    answer: ClassVar[Any]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class QueueState:
    """A batch job as its scheduler sees it (Slurm: worker/hostside/slurm.py): its id, the scheduler's state,
    why it waits (`Resources`, `Priority`, ...) and, while it waits, when the scheduler expects it to start."""

    job_id: str
    state: str
    reason: str | None = None
    expected_start: float | None = None  # seconds since the epoch

    @classmethod
    def from_wire(cls, raw: Any) -> "QueueState | None":
        if raw is None:
            return None
        raw = _object(raw)
        start = _typed(raw, "expected_start", (int, float), True)
        return cls(_typed(raw, "job_id", str), _typed(raw, "state", str), _typed(raw, "reason", str, True),
                   float(start) if start is not None else None)

    @property
    def ended_at_time_limit(self) -> bool:
        return self.state == "TIMEOUT"


@dataclass(frozen=True)
class LaunchAnswer:
    pid: int  # the wrapper's pid; for a batch job its job id
    already: bool
    # the layer that holds the attempt's processes (worker/hostside/: systemd-scope, cgroup, session, or slurm)
    containment: str | None = None
    # a batch job may wait in its scheduler's queue (pending) before it runs
    state: NodeState = NodeState.RUNNING
    queue: QueueState | None = None
    # asked with `totals`: what the host read for the trainer's total steps (worker/hostside/totals.py), untrusted:
    # server/log_patterns.py total_from_facts reads it
    totals: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "LaunchAnswer":
        return cls(_typed(raw, "pid", int), _typed(raw, "already", bool), _typed(raw, "containment", str, True),
                   NodeState(_typed(raw, "state", str, True) or NodeState.RUNNING),
                   QueueState.from_wire(raw.get("queue")), _typed(raw, "totals", dict, True))


@dataclass(frozen=True)
class SlurmBatch:
    """A batch script for `sbatch` and the job's name (unique per attempt node: a lost submit is found by it)."""

    script: str
    job_name: str


@dataclass(frozen=True)
class TotalsQuery:
    """What the host reads for a foreign trainer's total steps (worker/hostside/totals.py): its config's keys
    (`config`, relative to `cwd`) under its command line's `flags` and `overrides`, and its data's size. Built from
    the run's command line by server/log_patterns.py totals_query, for speculators' and SpecForge's `train`."""

    trainer: str
    cwd: str | None
    config: str | None
    flags: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchRequest(Request):
    """Start the job detached in `dir`; a second launch of the same dir returns the first pid.
    `node_address` (multi-node runs) is where the other nodes reach this host."""

    verb: ClassVar[str] = "launch"
    answer: ClassVar[Any] = LaunchAnswer
    dir: str
    token: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    node_address: str | None = None
    # submit this batch job to Slurm instead of starting `argv` (the script starts torchrun on the allocated nodes)
    slurm: SlurmBatch | None = None
    # read the facts of the trainer's total steps too (node 0 of an entrypoint run that totals_query names)
    totals: TotalsQuery | None = None


@dataclass(frozen=True)
class ReadFrom:
    """Byte offsets to read an attempt's metrics and log from, each with the identity of its file that the read to
    there answered (worker/hostside/files.py read_from: a file written anew since is read again from its start)."""

    metrics_offset: int = 0
    log_offset: int = 0
    metrics_identity: dict[str, Any] | None = None
    log_identity: dict[str, Any] | None = None


@dataclass(frozen=True)
class HostTimes:
    """The wrapper's record of when the job started and ended, and the host's clock at the answer, all in seconds
    since the epoch by the host's clock (worker/attempt_io.py sets them against the server's)."""

    started: float | None
    ended: float | None
    now: float

    @classmethod
    def from_wire(cls, raw: Any) -> "HostTimes | None":
        if not isinstance(raw, dict):
            return None
        times = [raw.get(k) if _finite(raw.get(k)) else None for k in ("started", "ended", "now")]
        return cls(*times) if times[2] is not None else None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ProbeAnswer:
    state: NodeState
    exit_code: int | None
    pid: int | None
    metrics: str
    metrics_offset: int
    log: str
    log_offset: int
    more: bool
    gpus: GpusAnswer | None = None
    # a node found lost (its wrapper dead): the processes of it that the probe stopped, and any still alive
    stopped: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    # a node that ended badly: what the host saw that the job could not say (its disk is full)
    note: str | None = None
    # a batch job: what its scheduler says of it
    queue: QueueState | None = None
    # a job that exited non-zero: torch elastic's error file and the log's end (worker/failure_cause.py)
    failure: dict[str, str | None] | None = None
    # each file's identity at the new offset, to be sent with it next time
    metrics_identity: dict[str, Any] | None = None
    log_identity: dict[str, Any] | None = None
    # the files the job truncated or wrote anew since the offset read from: [{"file", "offset", "how"}], each read
    # again from its start
    reread: list[dict[str, Any]] = field(default_factory=list)
    # a job the wrapper holds (not a batch job): when it started and ended
    times: HostTimes | None = None
    # bytes of the log passed over before `log` (it starts that far after the offset read from, or after 0 when the
    # log is read again): once the job is over, only the last bytes the server keeps are read
    log_skipped: int = 0
    # bytes of the log after this read's end, as the host saw its size
    log_left: int = 0

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "ProbeAnswer":
        raw = _object(raw)
        return cls(NodeState(_typed(raw, "state", str)), _typed(raw, "exit_code", int, True),
                   _typed(raw, "pid", int, True), _typed(raw, "metrics", str), _typed(raw, "metrics_offset", int),
                   _typed(raw, "log", str), _typed(raw, "log_offset", int), _typed(raw, "more", bool),
                   GpusAnswer.from_wire(_object(raw["gpus"])) if raw.get("gpus") else None,
                   _pids(raw, "stopped", True), _pids(raw, "remaining", True), _typed(raw, "note", str, True),
                   QueueState.from_wire(raw.get("queue")), _failure(raw.get("failure")),
                   _identity(raw.get("metrics_identity")), _identity(raw.get("log_identity")),
                   _reread(raw.get("reread")), HostTimes.from_wire(raw.get("times")),
                   max(0, _typed(raw, "log_skipped", int, True) or 0), max(0, _typed(raw, "log_left", int, True) or 0))


def _identity(raw: Any) -> dict[str, Any] | None:
    """A file's identity as the host said it: an inode and two short digests, else none (nothing is compared)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("inode"), int):
        return None
    digests = {k: raw.get(k) for k in ("head", "tail")}
    if not all(isinstance(v, str) and len(v) <= 64 for v in digests.values()):
        return None
    return {"inode": raw["inode"], **digests}


def _reread(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        return []
    return [{"file": r["file"][:255], "offset": r["offset"], "how": r["how"][:32]} for r in raw[:2]
            if isinstance(r, dict) and isinstance(r.get("file"), str) and isinstance(r.get("offset"), int)
            and isinstance(r.get("how"), str)]


def _failure(raw: Any) -> dict[str, str | None] | None:
    if not isinstance(raw, dict):
        return None
    return {k: raw[k] if isinstance(raw.get(k), str) else None for k in ("error_file", "log_tail")}


@dataclass(frozen=True)
class ProbeRequest(Request):
    """Status, new metric lines and log text; with `gpus` also a GPU snapshot, in the same round trip."""

    verb: ClassVar[str] = "probe"
    answer: ClassVar[Any] = ProbeAnswer
    dir: str
    metrics_offset: int
    log_offset: int
    gpus: GpuQuery | None = None
    metrics_identity: dict[str, Any] | None = None
    log_identity: dict[str, Any] | None = None
    # the most bytes of each file one answer carries (the host's own bound is READ_LIMIT): smaller while the
    # store refuses the writes a larger answer needs
    limit: int = READ_LIMIT


@dataclass(frozen=True)
class CancelAnswer:
    # pids still alive; for a batch job also its job id while the scheduler has not ended it
    remaining: list[int]
    signalled: list[int]
    exit_code: int | None
    probe: ProbeAnswer | None = None
    gpus: GpusAnswer | None = None

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "CancelAnswer":
        return cls(_pids(raw, "remaining"), _pids(raw, "signalled"), _typed(raw, "exit_code", int, True),
                   ProbeAnswer.from_wire(raw["probe"]) if raw.get("probe") else None,
                   GpusAnswer.from_wire(_object(raw["gpus"])) if raw.get("gpus") else None)


@dataclass(frozen=True)
class CancelRequest(Request):
    """Stop the attempt and verify; in the same round trip, with `probe` a last read from those offsets,
    with `gpus` a GPU snapshot once nothing of it remains."""

    verb: ClassVar[str] = "cancel"
    answer: ClassVar[Any] = CancelAnswer
    dir: str
    grace: float
    probe: ReadFrom | None = None
    gpus: GpuQuery | None = None


@dataclass(frozen=True)
class CleanAnswer:
    removed: int
    kept: list[str]

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "CleanAnswer":
        kept = _typed(raw, "kept", list, optional=True) or []
        if not all(isinstance(name, str) for name in kept):
            raise TypeError("kept holds something other than file names")
        return cls(_typed(raw, "removed", int), list(kept))


@dataclass(frozen=True)
class CleanRequest(Request):
    """Empty `path` strictly inside `workspace` and outside longrun's `records`; with `keep_into`,
    move the exported draft there first."""

    verb: ClassVar[str] = "clean"
    answer: ClassVar[Any] = CleanAnswer
    workspace: str
    records: str
    path: str
    keep_into: str | None = None


@dataclass(frozen=True)
class GpusRequest(GpuQuery, Request):
    verb: ClassVar[str] = "gpus"
    answer: ClassVar[Any] = GpusAnswer


@dataclass(frozen=True)
class InterconnectAnswer:
    """The raw `nvidia-smi topo -m` and all-reduce sweep outputs; worker/interconnect.py reads them."""

    topo: CommandOutput
    sweep: CommandOutput

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "InterconnectAnswer":
        return cls(CommandOutput.from_wire(raw["topo"]), CommandOutput.from_wire(raw["sweep"]))


@dataclass(frozen=True)
class InterconnectRequest(Request):
    """Run `nvidia-smi topo -m` (the agent's TOPO_CMD) and the all-reduce sweep at `tp` ranks (`tp` "all": every GPU); the sweep script travels
    in `sweep_source` and is installed at `sweep_path` (content-addressed) unless already there."""

    verb: ClassVar[str] = "interconnect"
    answer: ClassVar[Any] = InterconnectAnswer
    tp: int | str
    sweep_path: str
    sweep_source: str
    sizes: list[int] | None = None
    timeout: float = 600.0


@dataclass(frozen=True)
class VerifierProbeAnswer:
    """worker/verifier_probe.py's raw exit status and output; worker/interconnect.py reads its JSON line
    (server/advisor/verifier.py read_probe)."""

    probe: CommandOutput

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "VerifierProbeAnswer":
        return cls(CommandOutput.from_wire(raw["probe"]))


@dataclass(frozen=True)
class VerifierProbeRequest(Request):
    """Time one decoder layer of the verifier whose config.json (or model directory) is `config` on the host, one
    rank's share at `tp` (experts over `ep` ranks), at 1..16 tokens: the script travels in `script_source` and is
    installed at `script_path` (content-addressed) unless already there."""

    verb: ClassVar[str] = "verifier"
    answer: ClassVar[Any] = VerifierProbeAnswer
    config: str
    tp: int
    ep: int
    script_path: str
    script_source: str
    timeout: float = 900.0
