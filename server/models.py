"""Tables. The schema is changed only by migrations in migrations/versions/."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from server import layout
from server.spec import RunCreate, stored_spec


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Stores UTC; SQLite drops the zone, so put it back on the way out."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Host(Base):
    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # how runs start there: "direct" or "slurm" (server/schemas.py HostKind)
    kind: Mapped[str] = mapped_column(String(16), default="direct", server_default="direct")
    address: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer, default=22)
    username: Mapped[str | None] = mapped_column(String(64))
    key_path: Mapped[str | None] = mapped_column(String(1024))
    host_key: Mapped[str | None] = mapped_column(Text)
    workspace: Mapped[str] = mapped_column(String(1024))
    # the workspace's real path, its symlinks followed on the host (the worker asks it there; None until then)
    workspace_real: Mapped[str | None] = mapped_column(String(4096))
    python: Mapped[str] = mapped_column(String(1024), default="python3")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    reachable: Mapped[bool | None] = mapped_column(Boolean)
    last_seen_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    gpu_snapshot: Mapped[dict[str, Any] | None]
    gpu_snapshot_at: Mapped[datetime | None]
    # set by GET /v1/hosts/{name}/gpus when the snapshot is too old; the worker answers it
    gpu_wanted_at: Mapped[datetime | None]
    # the last all-reduce table measured there (worker/interconnect.py: measurement, plus measured_at)
    interconnect: Mapped[dict[str, Any] | None]
    # set by POST /v1/hosts/{name}/interconnect (0: every GPU); the worker probes and clears it
    interconnect_wanted_tp: Mapped[int | None] = mapped_column(Integer)
    # why the last probe did not measure; cleared by the next request
    interconnect_error: Mapped[str | None] = mapped_column(Text)
    # set by POST /v1/hosts/{name}/verifier ({config, tp, ep}); the worker times the verifier's layers, stores them
    # as interconnect["verifier"] and clears it
    verifier_wanted: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # why the last verifier probe did not measure; cleared by the next request
    verifier_error: Mapped[str | None] = mapped_column(Text)
    # where the worker last reached it: user@address:port, after its ~/.ssh/config (an alias's HostName and Port)
    reached: Mapped[str | None] = mapped_column(String(512))
    # paths a submit asks about ({request id: [path, ...]}); the worker says which exist there in paths_found
    # ({request id: {path: "dir" | "file" | None}, or {"error": why}}), in one call for all, and clears what it answered
    paths_wanted: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    paths_found: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class TypedSpec:
    """`typed_spec`: the row's stored `spec` JSON as the typed spec (server/spec.py), read once per loaded value."""

    spec: Any

    @property
    def typed_spec(self) -> RunCreate:
        cached = self.__dict__.get("_typed_spec")
        if cached is None or cached[0] is not self.spec:
            cached = (self.spec, stored_spec(self.spec))
            self.__dict__["_typed_spec"] = cached
        return cached[1]


class Run(TypedSpec, Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]]
    hosts: Mapped[list[Any]]
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    max_retries: Mapped[int] = mapped_column(Integer, default=0)
    retries_used: Mapped[int] = mapped_column(Integer, default=0)
    clean_pending: Mapped[bool] = mapped_column(Boolean, default=False)
    message: Mapped[str | None] = mapped_column(Text)
    host_reachable: Mapped[bool] = mapped_column(Boolean, default=True)
    unreachable_since: Mapped[datetime | None]
    # worker steps in a row that raised something unexpected (server/lifecycle.py: step_failed)
    step_failures: Mapped[int] = mapped_column(Integer, default=0)
    latest: Mapped[dict[str, Any]] = mapped_column(default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]

    attempts: Mapped[list["Attempt"]] = relationship(
        back_populates="run", order_by="Attempt.number", cascade="all, delete-orphan"
    )

    @property
    def current(self) -> "Attempt":
        return next(a for a in self.attempts if a.number == self.attempt)


class Attempt(TypedSpec, Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    spec: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default="pending")
    token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str | None] = mapped_column(Text)
    # per node: server.lifecycle.AttemptNode as a dict; changed only through server/lifecycle.py
    nodes: Mapped[list[Any]] = mapped_column(default=list)
    # some node was given up on while its host was away: the worker's orphan reaper stops what is left there
    abandoned: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    metrics_lines: Mapped[int] = mapped_column(Integer, default=0)
    last_step: Mapped[int | None] = mapped_column(Integer)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    sec_per_step: Mapped[float | None] = mapped_column(Float)
    last_metric_at: Mapped[datetime | None]
    first_step_at: Mapped[datetime | None]
    # the server's clock, not the job's: when the step last moved on (ETA and stall detection)
    step_seen_at: Mapped[datetime | None]
    # when the stall rule found the step stuck; cleared when it moves again
    stalled_at: Mapped[datetime | None]
    # metric lines skipped as too long or too wide (worker/ingest.py)
    metrics_skipped: Mapped[int] = mapped_column(Integer, default=0)
    predicted_duration_seconds: Mapped[float | None] = mapped_column(Float)
    prediction_basis: Mapped[str | None] = mapped_column(Text)
    evaluation: Mapped[dict[str, Any] | None]

    run: Mapped[Run] = relationship(back_populates="attempts")

    @property
    def dir(self) -> str | None:
        return self.nodes[0]["dir"] if self.nodes else None

    @property
    def log_path(self) -> str | None:
        return layout.log_path(self.dir) if self.dir else None


class MetricPoint(Base):
    __tablename__ = "metric_points"
    # a metrics.jsonl line is stored once: (attempt, line) is its identity
    __table_args__ = (
        UniqueConstraint("run_id", "attempt", "line", "name"),
        Index("ix_metric_points_series", "run_id", "name", "attempt", "step"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    line: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(128))
    step: Mapped[int | None] = mapped_column(Integer)
    value: Mapped[float] = mapped_column(Float)
    time: Mapped[datetime]


class LogChunk(Base):
    __tablename__ = "log_chunks"
    __table_args__ = (UniqueConstraint("run_id", "attempt", "node", "offset"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node: Mapped[int] = mapped_column(Integer, default=0)
    offset: Mapped[int] = mapped_column(Integer)
    end: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)
