"""Pydantic schemas: what clients send (`*Create`, `RestartRequest`) and what they get back (`*Public`); the run
spec itself (`RunCreate` and its parts) is server/spec.py's."""

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError

from server.advisor import Advice
from server.layout import kernel_file_system
from server.lifecycle import AttemptStatus, RunStatus
from server.log_reads import ANSWER_BYTES, LINE_CHARS
from server.series import SERVER_SERIES_DOC
from server.spec import (
    MAX_STR,
    RESTART_TOP_LEVEL,
    TRAINER_FIELDS,
    AbsPath,
    Identifier,
    SafeStr,
    Strict,
    _absolute_path,
    normalized_path,
)
from server.spec import RunCreate as RunCreate
from server.spec import SlurmSpec as SlurmSpec
from server.spec import TrainerSpec as TrainerSpec
from server.spec import without_env_values as without_env_values

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _name(value: str) -> str:
    if not NAME_RE.match(value):
        raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")
    return value


Name = Annotated[str, AfterValidator(_name)]


# how runs start on a host: `direct` (a detached torchrun on the host itself), or `slurm` (the host is a Slurm
# login node; each attempt is a batch job, see SlurmSpec)
HostKind = Literal["direct", "slurm"]


def _workspace(value: str) -> str:
    """An absolute path not under /proc, /sys or /dev as given (a symlink that leads there is refused once resolved).
    One validator, not a second one after AbsPath's: pydantic 2.6 (the floor) kept only the last of the two."""
    value = _absolute_path(value)
    if (top := kernel_file_system(normalized_path(value))) is not None:
        raise ValueError(f"workspace {value!r} lies under {top}, a kernel file system whose paths name processes "
                         "and devices, not a directory longrun may write and clean under (/proc/self/cwd is the "
                         "directory of whichever process reads it); give a directory of longrun's own, e.g. "
                         "/srv/longrun")
    return value


Workspace = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_workspace)]


class HostCreate(Strict):
    name: Name
    kind: HostKind = Field("direct", description="`direct`: runs start on the host itself; `slurm`: the host is a "
                           "Slurm login node (its workspace on a file system the compute nodes share) and each attempt "
                           "is a batch job")
    address: Identifier = Field(description="hostname or IP; `local` for this machine")
    port: int = Field(22, ge=1, le=65535)
    username: Identifier | None = None
    key_path: AbsPath | None = None
    workspace: Workspace = Field(description="absolute directory on the host that longrun may write and clean under")
    host_key: SafeStr | None = Field(None, description="OpenSSH public key line of the host; else known_hosts")
    python: SafeStr = Field("python3", description="python on the host that has torch (and the trainer)")

    @model_validator(mode="after")
    def _workspace_not_root(self) -> "HostCreate":
        if normalized_path(self.workspace) == "/":
            raise ValueError("workspace must not be / (nor a spelling of it such as // or /.)")
        return self


class HostUpdate(Strict):
    """PATCH /v1/hosts/{name}: the fields given change, the others stay; null clears username, key_path and
    host_key (the server's user, its default keys, known_hosts)."""

    address: Identifier | None = None
    port: int | None = Field(None, ge=1, le=65535)
    username: Identifier | None = None
    key_path: AbsPath | None = None
    workspace: Workspace | None = None
    host_key: SafeStr | None = Field(None, description="OpenSSH public key line of the host; null: known_hosts")
    python: SafeStr | None = None

    @model_validator(mode="after")
    def _required_stay_set(self) -> "HostUpdate":
        for field in ("address", "port", "workspace", "python"):
            if field in self.model_fields_set and getattr(self, field) is None:
                raise ValueError(f"{field} cannot be cleared, only changed")
        if self.workspace is not None and normalized_path(self.workspace) == "/":
            raise ValueError("workspace must not be / (nor a spelling of it such as // or /.)")
        return self


class HostPublic(BaseModel):
    name: str
    kind: str
    address: str
    port: int
    username: str | None
    workspace: str
    workspace_real: str | None = Field(None, description="the workspace's real path, its symlinks followed on the "
                                       "host (null until a worker has asked there)")
    python: str
    reachable: bool | None
    reached: str | None = Field(None, description="where the worker last reached the host: user@address:port after "
                                "its ~/.ssh/config (an alias's HostName and Port); null until then, and for local")
    last_seen_at: datetime | None
    last_error: str | None
    gpus: dict[str, Any] | None = None
    gpus_sampled_at: datetime | None = None


class GpuSnapshotPublic(BaseModel):
    host: str
    sampled_at: datetime | None
    reachable: bool | None
    available: bool = Field(description="false when the host has no usable GPU; `message` says why")
    message: str | None
    gpus: list[dict[str, Any]] = Field(description="index, uuid, name, utilization_pct, memory_used_mib, "
                                       "memory_total_mib, processes [{pid, user, used_memory_mib, ...}]")


class InterconnectProbeCreate(Strict):
    tp: int | None = Field(None, ge=1, le=64, description="ranks of the all-reduce (GPUs); unset: every GPU of the host")


class AllreduceTime(BaseModel):
    bytes: int
    us: float = Field(description="one NCCL all-reduce call of this message size, µs")


class InterconnectPublic(BaseModel):
    """A host's measured all-reduce table (the last probe that measured) and the state of the newest probe."""

    host: str
    status: Literal["not_measured", "pending", "measured", "failed"] = Field(
        description="pending: a probe is under way; failed: the newest probe did not measure (`message` says why; "
        "an older table, if any, is still shown)")
    requested_tp: int | None = Field(None, description="tp of the probe under way (null with pending: every GPU)")
    message: str | None = None
    tp: int | None = Field(None, description="ranks the table was measured with")
    interconnect: Literal["nvlink", "pcie"] | None = Field(
        None, description="the links between the measured GPUs by nvidia-smi topo -m (pcie also with "
        "NCCL_P2P_DISABLE=1); null when the topology could not be read")
    measured_at: datetime | None = None
    allreduce: list[AllreduceTime] = Field(default_factory=list)
    gpus: list[str] = Field(default_factory=list)
    gpu_count: int | None = None
    nccl_env: dict[str, str] = Field(default_factory=dict)
    topology: dict[str, Any] | None = Field(None, description="gpus, links [{a, b, path}], interconnect, note")


class VerifierProbeCreate(Strict):
    config: AbsPath = Field(description="the verifier's config.json, or its model directory, on the host")
    tp: int = Field(ge=1, le=64, description="the engine's tensor parallelism: one rank's share of each layer is timed")
    ep: int = Field(1, ge=1, le=64, description="an MoE verifier's expert parallelism: 1 (every expert sliced by tp) "
                    "or the tp (whole experts over the ranks)")

    @model_validator(mode="after")
    def _ep_is_1_or_tp(self) -> "VerifierProbeCreate":
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep is 1 (experts sliced by tp) or the tp ({self.tp}), not {self.ep}")
        return self


class VerifierProbePublic(BaseModel):
    """The verifier's layer times measured on a host (the last probe that measured), stored beside its all-reduce
    table, and the state of the newest probe."""

    host: str
    status: Literal["not_measured", "pending", "measured", "failed"] = Field(
        description="pending: a probe is under way; failed: the newest probe did not measure (`message` says why; "
        "an older measurement, if any, is still shown)")
    requested: dict[str, Any] | None = Field(None, description="config, tp and ep of the probe under way")
    message: str | None = None
    path: str | None = Field(None, description="the config the probe read on the host (what deploy.verifier or the "
                             "trainer's verifier_path must name for the proposal to use these times)")
    tp: int | None = None
    ep: int | None = None
    gpu: str | None = None
    dtype: str | None = Field(None, description="the weights' dtype timed (bf16 where this torch had no kernel for "
                              "the checkpoint's: then an upper bound)")
    measured_at: str | None = None
    dense_ms: list[float] = Field(default_factory=list, description="one dense layer's share at 1..16 tokens, ms")
    moe_ms: list[float] = Field(default_factory=list, description="one MoE layer's share at 1..16 tokens, ms")



def _optional(info: FieldInfo) -> tuple[Any, Any]:
    """A spec field as an override: the same type and bounds, or null; left out unless given."""
    annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return annotation | None, Field(None, description=info.description)


class _Overrides(Strict):
    """What a restart changes: the fields given replace the run's; one given as null clears it."""

    @model_validator(mode="wrap")
    @classmethod
    def _name_what_is_allowed(cls, value: Any, handler: Any) -> Any:
        """An unknown key is refused naming it and what may be overridden (pydantic's own says only "Extra inputs
        are not permitted")."""
        try:
            return handler(value)
        except ValidationError as exc:
            if not any(e["type"] == "extra_forbidden" for e in exc.errors()):
                raise
            errors = [InitErrorDetails(type=PydanticCustomError(
                "extra_forbidden", "unknown override {key}; allowed: {allowed}",
                {"key": repr(str(e["loc"][0])[:64]), "allowed": ALLOWED_OVERRIDES}), loc=e["loc"], input=e["input"])
                if e["type"] == "extra_forbidden" else e for e in exc.errors()]
            raise ValidationError.from_exception_data(exc.title, errors) from None

    def given(self) -> dict[str, Any]:
        """The overrides as the request gave them (JSON), e.g. for the restart's event."""
        return self.model_dump(mode="json", exclude_unset=True)

    def top_level(self) -> dict[str, Any]:
        """The run spec's own fields given."""
        return {k: getattr(self, k) for k in self.model_fields_set & RESTART_TOP_LEVEL}

    def trainer(self) -> dict[str, Any]:
        """The trainer's fields given (a trainer run's `trainer`)."""
        return {k: getattr(self, k) for k in self.model_fields_set & TRAINER_FIELDS}


assert not RESTART_TOP_LEVEL & TRAINER_FIELDS  # an override names its field without saying where it is
ALLOWED_OVERRIDES = (f"{', '.join(sorted(RESTART_TOP_LEVEL))}; and for a trainer run the trainer's fields: "
                     f"{', '.join(sorted(TRAINER_FIELDS))}")
# every field RestartOverrides takes is one of RunCreate's (RESTART_TOP_LEVEL) or TrainerSpec's, of the same type
RestartOverrides = create_model(
    "RestartOverrides", __base__=_Overrides, __module__=__name__,
    **{name: _optional(info) for name, info in RunCreate.model_fields.items() if name in RESTART_TOP_LEVEL},
    **{name: _optional(info) for name, info in TrainerSpec.model_fields.items()},
)


class RestartRequest(Strict):
    overrides: RestartOverrides = Field(default_factory=RestartOverrides, description="fields of the run spec to "
                                        "change, the trainer's by their own names (`ttt_steps`); unknown ones are a 422")
    clean: bool = Field(False, description="empty the output directory first: a trainer run starts at step 0 "
                        "(fresh)")
    resume: bool = Field(False, description="trainer runs: resume the output directory's checkpoint even when it "
                         "was trained at another TTT depth (without it, or clean, such a restart is a 422)")
    init_from_last: bool = Field(False, description="warm start: trainer runs start from the last attempt's draft (--init-from)")


class AttemptPublic(BaseModel):
    number: int
    spec: dict[str, Any]
    status: AttemptStatus
    created_at: datetime
    started_at: datetime | None = Field(description="when the job started, by its host wrapper's record (the "
                                        "host's clock set against the server's); else when the worker launched it")
    first_step_at: datetime | None = Field(None, description="when the first metric line with a step arrived")
    ended_at: datetime | None = Field(description="when the job ended, by its host wrapper's record; else when the "
                                      "worker saw it end")
    exit_code: int | None
    message: str | None
    log_path: str | None
    nodes: list[dict[str, Any]]
    last_step: int | None
    total_steps: int | None
    seconds_per_step: float | None
    predicted_duration_seconds: float | None
    actual_duration_seconds: float | None
    prediction_error: float | None = Field(None, description="(actual - predicted) / predicted, once the attempt finished")
    metrics_skipped: int = Field(0, description="metric lines and values of the attempt not stored: lines too long or "
                                 "wide, non-finite values (NaN, ±Infinity: shown in the run's `latest` as \"NaN\", "
                                 "\"Infinity\", \"-Infinity\"), lines whose step is no whole number from 0 to "
                                 "2^31-1; each reason said once in a `metrics_skipped` event")


class InputBoundPublic(BaseModel):
    """The trainer's wait for data, said when it takes a noticeable share of the step (trainer/series.py)."""

    share: float = Field(description="the share of the latest steps' time spent waiting for the next batch "
                         "(the trainer's `input_bound`, over its last ten steps)")
    data_wait_s: float | None = Field(None, description="the latest step's wait for its batch, seconds")
    step_time_s: float | None = Field(None, description="the latest step's time, seconds")
    note: str = Field(description="what it means and what to do about it, in words")


class RunPublic(BaseModel):
    id: str
    name: str
    status: RunStatus
    message: str | None
    attempt: int
    hosts: list[str]
    spec: dict[str, Any]
    progress: float | None
    progress_note: str | None = Field(None, description="an entrypoint run with no known total: how to give one")
    eta_seconds: float | None
    host_reachable: bool
    latest: dict[str, Any] = Field(description=f"each series' newest value, keyed by name: {SERVER_SERIES_DOC}")
    input_bound: InputBoundPublic | None = Field(None, description="when the latest steps waited for data a tenth "
                                                 "of their time or more: the disk, not the GPU, sets the pace")
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    attempts: list[AttemptPublic]


class RunPage(BaseModel):
    items: list[RunPublic]
    next_cursor: str | None = Field(None, description="pass as `cursor` for the next page")


class DryRunPublic(BaseModel):
    dry_run: Literal[True] = True
    new_spec: dict[str, Any]
    predicted_duration_seconds: float | None
    predicted_finish: datetime | None
    basis: str
    start: Literal["resume", "fresh", "unknown"] = Field("unknown", description="whether the new attempt resumes "
                                                         "the checkpoint in its output dir or trains from step 0")
    resumes_from_step: int | None = Field(None, description="the checkpoint's step when it resumes (the prediction "
                                          "counts only the steps after it)")
    resumes_ttt_steps: int | None = Field(None, description="the TTT depth that checkpoint was trained with")
    start_reason: str = ""


class MetricPointPublic(BaseModel):
    attempt: int
    step: int | None
    value: float
    time: datetime


class MetricsPublic(BaseModel):
    series: dict[str, list[MetricPointPublic]] = Field(description=f"keyed by name: {SERVER_SERIES_DOC}")


class LogsPublic(BaseModel):
    attempt: int
    log_path: str | None
    lines: list[str] = Field(description=f"whole lines, at most {ANSWER_BYTES >> 20} MiB of the log's bytes an "
                             "answer (server/log_reads.py), or one line longer than that; a line longer than "
                             f"{LINE_CHARS:,} characters is cut there, a marker saying so after it")
    next_offset: int = Field(description="pass as since_offset to follow the log, or to read on where `more`")
    more: bool = Field(False, description="a read from since_offset stopped at the answer's bound: more of the "
                       "log follows next_offset")
    dropped_bytes: int = Field(0, description="bytes of the log before `lines` that are no longer stored: longrun "
                               "keeps the last 64 MiB of each node's log per attempt (the file on the host is whole)")


class TracebackPublic(BaseModel):
    attempt: int
    node: int = Field(description="the node whose log holds the rank's failure (0 is the first host)")
    rank: int = Field(description="the global rank, as torchrun numbers it")
    root_cause: bool = Field(description="torchrun's first observed failure (the others were mostly stopped "
                             "because of it)")
    traceback: str = Field(description="what the rank recorded in torch elastic's error file (its exception's "
                           "traceback, with @record), or torchrun's word on how it ended (a signal)")


class DepthAcceptance(BaseModel):
    model_config = ConfigDict(extra="allow")

    depth: int
    mean_accepted: float = Field(description="tokens accepted per round at this depth, the bonus token included")
    measured_accepted: float | None = Field(None, description="the same from decoding at this depth for real")
    verifier_passes: int | None = None


class AttemptEvaluation(BaseModel):
    """One attempt's acceptance report, as `python -m trainer.evaluate` prints it (more fields are kept)."""

    model_config = ConfigDict(extra="allow")

    attempt: int
    ttt_steps: int | None = Field(description="the TTT depth the attempt trained with (trainer runs)")
    by_depth: list[DepthAcceptance] = Field(default_factory=list)
    position_acceptance: list[float] = Field(
        default_factory=list, description="[i]: the probability that drafted tokens 1..i+1 are all accepted")
    conditional_acceptance: list[float] | None = None


class EvaluationPublic(AttemptEvaluation):
    """The newest evaluated attempt's report, and every attempt's in `by_attempt`, oldest first."""

    by_attempt: list[AttemptEvaluation]


class RunAdvicePublic(Advice):
    """The advice for one attempt's evaluated draft (`attempt`), its retrain times predicted from measured steps."""

    attempt: int
    deploy_host: str | None = Field(None, description="the host whose measured all-reduce table was used")
    allreduce_source: Literal["built-in default", "deploy host"] = Field(
        "built-in default", description="whether the all-reduce times were measured on deploy_host by "
        "probe-interconnect or are the built-in tables (`allreduce_basis` says which)")
