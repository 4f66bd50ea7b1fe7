"""The host protocol: one request and one answer type per verb of worker/hostside.py.

On the wire each request is a JSON object (`to_wire`) and each answer one JSON line, read back with
`from_wire`; the field names are hostside.py's. worker/host_agent.py sends them over a transport;
tests/worker/fake_host.py answers them from an in-memory host.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from server.lifecycle import NodeState
from worker.gpus import QUERY_APPS_CMD, QUERY_GPU_CMD, GpuSnapshot, attach_users, snapshot_from_outputs


@dataclass(frozen=True)
class GpuView:
    """A GPU snapshot plus which of its processes carry which attempt token."""

    snapshot: GpuSnapshot
    token_of: dict[int, str]

    def pids_of(self, tokens: set[str]) -> set[int]:
        return {pid for pid, token in self.token_of.items() if token in tokens}


@dataclass(frozen=True)
class GpuQuery:
    """Ask for nvidia-smi's two answers and which process carries which of `tokens`."""

    tokens: list[str]
    query_gpu: list[str] = field(default_factory=lambda: list(QUERY_GPU_CMD))
    query_apps: list[str] = field(default_factory=lambda: list(QUERY_APPS_CMD))


@dataclass(frozen=True)
class CommandOutput:
    rc: int
    stdout: str
    stderr: str


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
        return cls(CommandOutput(**raw["gpu"]), CommandOutput(**raw["apps"]),
                   {int(pid): GpuOwner(o.get("user"), o.get("token")) for pid, o in raw.get("owners", {}).items()})

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
class LaunchAnswer:
    pid: int
    already: bool

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "LaunchAnswer":
        return cls(int(raw["pid"]), bool(raw["already"]))


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


@dataclass(frozen=True)
class ReadFrom:
    """Byte offsets to read an attempt's metrics and log from."""

    metrics_offset: int = 0
    log_offset: int = 0


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

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "ProbeAnswer":
        return cls(NodeState(raw["state"]), raw["exit_code"], raw["pid"], raw["metrics"], raw["metrics_offset"],
                   raw["log"], raw["log_offset"], raw["more"],
                   GpusAnswer.from_wire(raw["gpus"]) if raw.get("gpus") else None)


@dataclass(frozen=True)
class ProbeRequest(Request):
    """Status, new metric lines and log text; with `gpus` also a GPU snapshot, in the same round trip."""

    verb: ClassVar[str] = "probe"
    answer: ClassVar[Any] = ProbeAnswer
    dir: str
    metrics_offset: int
    log_offset: int
    gpus: GpuQuery | None = None


@dataclass(frozen=True)
class CancelAnswer:
    remaining: list[int]
    signalled: list[int]
    exit_code: int | None
    probe: ProbeAnswer | None = None
    gpus: GpusAnswer | None = None

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "CancelAnswer":
        return cls(list(raw["remaining"]), list(raw["signalled"]), raw["exit_code"],
                   ProbeAnswer.from_wire(raw["probe"]) if raw.get("probe") else None,
                   GpusAnswer.from_wire(raw["gpus"]) if raw.get("gpus") else None)


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
        return cls(int(raw["removed"]), list(raw.get("kept", [])))


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
