"""Reading an attempt's nodes on their hosts, and storing what was read: metric lines, log text, GPU samples."""

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.layout import LOG_FILE
from server.lifecycle import AttemptNode, NodeState, node_probed, nodes_of
from server.models import Attempt, Host, MetricPoint, Run
from worker.gpu_placement import gpu_readings
from worker.host_contact import HostContact, store_snapshot
from worker.hostside.files import READ_LIMIT
from worker.ingest import say_log_skipped, say_reread, store_log, store_log_metrics, store_metrics
from worker.protocol import GpuView, HostTimes, ProbeAnswer, ReadFrom

# how far a host's record of a job's start may lie before the attempt was opened (the two clocks set against each
# other through one answer's round trip)
CLOCK_SLACK_SECONDS = 5.0


@dataclass(frozen=True)
class NodeProbe:
    """What one node's host said, read from `read_from`."""

    index: int
    read_from: ReadFrom
    answer: ProbeAnswer


def read_from(attempt: Attempt) -> list[ReadFrom]:
    """Where each node's files were read up to, and what they were there."""
    return [ReadFrom(n.metrics_offset, n.log_offset, n.metrics_identity, n.log_identity) for n in nodes_of(attempt)]


def probe_nodes(contact: HostContact, attempt: Attempt, hosts: dict[str, Host],
                with_gpus: bool = False, limit: int = READ_LIMIT) -> list[NodeProbe]:
    """One probe per node: its state, new metric lines and log text (at most `limit` bytes of each), and with_gpus
    a GPU snapshot."""
    out = []
    for i, (node, offsets) in enumerate(zip(nodes_of(attempt), read_from(attempt), strict=True)):
        answer = contact.agent(hosts[node.host]).probe(node.dir, offsets,
                                                       gpu_tokens=[attempt.token] if with_gpus else None,
                                                       limit=limit)
        out.append(NodeProbe(i, offsets, answer))
    return out


def store_probes(session: Session, run: Run, attempt: Attempt, probes: list[NodeProbe], now: datetime) -> None:
    """Store what the probes read; skipped for a node whose offsets moved since (already stored)."""
    nodes, offsets = nodes_of(attempt), read_from(attempt)
    for p in probes:
        node, a = nodes[p.index], p.answer
        if offsets[p.index] != p.read_from:
            continue
        for reread in a.reread:
            say_reread(session, run, attempt, p.index, reread)
        job_times = _job_times(attempt, node, a.times, now)
        if p.index == 0 and job_times[0] is not None:
            attempt.started_at = datetime.fromtimestamp(job_times[0], UTC)
        # lines read after the job ended were written by then: those without a time of their own are not taken
        # as later (the server may have been down since)
        read_at = now if None in job_times else min(now, datetime.fromtimestamp(sum(job_times), UTC))
        if p.index == 0 and a.metrics:
            store_metrics(session, run, attempt, a.metrics, read_at)
        log_position, log_base = (node.log_records, node.log_midline), None
        if any(r["file"] == LOG_FILE for r in a.reread):
            # the log written anew: its text is stored after what was stored of it, its records counted on
            log_base, log_position = node.log_base + node.log_offset, (node.log_records, False)
            node.log_base, node.log_offset = log_base, 0
        # the host passed over what lies before the log's kept tail: the text starts that far on, at a line start
        start = min(node.log_offset + a.log_skipped, a.log_offset)
        if start > node.log_offset:
            say_log_skipped(session, run, attempt, p.index, node.log_base + node.log_offset, node.log_base + start)
            log_position = (log_position[0], False)
        if p.index == 0:
            # the read ends mid-record only while the job runs or the read was cut short; once the job is over, its
            # records are read from the log's end only (`left`)
            over = a.state not in (NodeState.RUNNING, NodeState.PENDING) and not a.remaining
            log_position = store_log_metrics(session, run, attempt, log_position, a.log,
                                             a.state != NodeState.RUNNING and not a.more, read_at,
                                             left=a.log_left if over else None)
        store_log(session, run.id, attempt.number, p.index, node.log_base + start, node.log_base + a.log_offset,
                  a.log)
        if a.gpus is not None:
            host = session.scalar(select(Host).where(Host.name == node.host))
            store_gpu_sample(session, run, attempt, p.index, a.gpus.view(), host, now)
        node_probed(attempt, p.index, a.metrics_offset, a.log_offset, a.state, a.exit_code, log_position,
                    (a.metrics_identity, a.log_identity), log_base, job_times)


def _job_times(attempt: Attempt, node: AttemptNode, times: HostTimes | None,
               now: datetime) -> tuple[float | None, float | None]:
    """The node's (started, ran): when its wrapper started the job, set against the server's clock by the host's
    clock in the same answer (taken once), and how long the job ran (once it has ended). A host's
    word is untrusted: a start before the attempt was opened or after now, or an end past now, is not taken; one
    off by less than the clocks' slack is held to those bounds, so an attempt ends before the next one starts."""
    started, ran = node.started, node.ran
    if times is None or times.started is None:
        return started, ran
    offset = now.timestamp() - times.now
    if started is None:
        mapped = times.started + offset
        opened = _not_before(attempt)
        if opened - CLOCK_SLACK_SECONDS <= mapped <= now.timestamp():
            started = max(mapped, opened)
    if started is not None and ran is None and times.ended is not None:
        # the end set against the server's clock as the start was (a batch job requeued since started again)
        took = times.ended + offset - started
        if 0 <= took and started + took <= now.timestamp() + CLOCK_SLACK_SECONDS:
            ran = min(took, now.timestamp() - started)
    return started, ran


def _not_before(attempt: Attempt) -> float:
    """The earliest an attempt's job can have started, by the server's clock: once the attempt was opened, and once
    every attempt before it had ended (a restart or a retry launches n+1 only after n has stopped). A start mapped
    earlier is an estimate's error: a scheduler's record in whole seconds (Slurm's StartTime), or the offset
    between the clocks."""
    bounds = [attempt.created_at] if attempt.created_at else []
    run = attempt.run
    if run is not None:
        bounds += [a.ended_at for a in run.attempts if a.number < attempt.number and a.ended_at is not None]
    return max(b.timestamp() for b in bounds) if bounds else float("-inf")


def store_gpu_sample(session: Session, run: Run, attempt: Attempt, index: int, view: GpuView, host: Host,
                     now: datetime) -> None:
    """GPU utilisation and memory of the GPUs this attempt uses, as metrics of the run."""
    store_snapshot(session, host.id, view, now)
    readings = gpu_readings(view, attempt.token, nodes_of(attempt)[index].gpus, index)
    session.add_all(MetricPoint(run_id=run.id, attempt=attempt.number, line=None, name=name, step=attempt.last_step,
                                value=value, time=now) for name, value in readings.items())
    if readings and attempt.number == run.attempt:
        run.latest = {**(run.latest or {}), **readings}
