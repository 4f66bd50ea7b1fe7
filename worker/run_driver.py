"""The run driver: moves one claimed run along by one step, with one handler per state.

Every step reads the run, talks to its hosts (one agent call per node and action), then applies what it
learned in one short write transaction (worker/run_rows.fresh_run) through the rules of server/lifecycle.py,
so an API call that changed the run meanwhile always wins and nothing is applied twice.
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session

from server.config import Settings
from server.db import Database, is_store_failure
from server.lifecycle import (
    ENDED_ATTEMPT,
    AttemptStatus,
    NodeFailure,
    NodeState,
    RunStatus,
    attempt_finished,
    cancel_settled,
    ended_badly,
    fail_run,
    host_answering,
    host_unreachable,
    is_unchanged,
    job_queued,
    launched,
    nodes_launched,
    nodes_of,
    plan_nodes,
    restart_blocked,
    restart_cleared,
    stall_seen,
    start_launching,
    step_failed,
    step_succeeded,
    total_found,
    wait_for_gpus,
)
from server.models import Attempt, Host, Run
from server.spec import RunCreate
from worker import failure_cause
from worker.attempt_io import probe_nodes, store_probes
from worker.attempt_stopper import AttemptStopper
from worker.clock import Clock
from worker.gpu_placement import WaitForGpus, placement_env, visible_devices
from worker.host_contact import HostContact, mark_unreachable, store_snapshot
from worker.host_errors import HostError, HostUnreachable
from worker.jobs import job_argv
from worker.log_metrics import found_total, totals_query
from worker.protocol import GpuView, LaunchRequest
from worker.run_rows import attempt_numbered, fresh_run, read_run
from worker.slurm import queue_message, slurm_batch
from worker.transport_pool import LOCAL_ADDRESS
from worker.workspace_check import refuse_workspace

log = logging.getLogger("longrun.worker")
# the least a probe reads of each file while the store refuses writes: a few hundred metric lines
MIN_READ_BYTES = 16 << 10
# the most a step reads of each file and stores in its one transaction (about 500 metric lines of 20 fields, 0.1 to
# 0.3 s of SQLite's time); what is left is read in the next step, at once. On SQLite the API's writes wait for the
# write transaction under way: a job writing faster than a tick's ingest kept up with had each step store all the
# host hands back (READ_LIMIT, 4 MiB: seconds of SQLite's time), and 100 clients' writes beside two such jobs had
# a p99 of 3.2 s on two cores (benchmarks/bench_write_beside_ingest.py, docs/benchmarks.md)
INGEST_READ_BYTES = 256 << 10

# a handler returns True when it left the run with more to do at once (queued or retried: now launching)
Handler = Callable[[Run, dict[str, Host]], bool | None]


class RunDriver:
    def __init__(self, db: Database, settings: Settings, contact: HostContact, stopper: AttemptStopper,
                 worker_id: str, clock: Clock):
        self.db, self.settings, self.contact, self.stopper = db, settings, contact, stopper
        self.worker_id, self.clock = worker_id, clock
        self._lock = threading.Lock()
        # run id -> the bytes of each file its probes read while the store refuses writes (INGEST_READ_BYTES otherwise)
        self._read_limit: dict[str, int] = {}
        # run id -> monotonic time its GPUs were last sampled
        self._gpu_sampled: dict[str, float] = {}
        # (run id, attempt) -> (its step, the monotonic time this worker first saw that step): the stall rule's clock
        self._step_watch: dict[tuple[str, int], tuple[int | None, float]] = {}
        self._handlers: dict[RunStatus, Handler] = {
            RunStatus.QUEUED: self._queue,
            RunStatus.LAUNCHING: self._launch,
            RunStatus.RUNNING: self._poll,
            RunStatus.CANCELLING: self._cancel,
            RunStatus.RESTARTING: self._restart,
        }

    def step(self, run_id: str) -> bool:
        """Move one run along by one step, whatever state it is in; host trouble goes to the lifecycle's rules.

        True when the run has more to do at once: its next step should not wait for the next tick."""
        run, hosts = read_run(self.db, run_id)
        handler = self._handlers.get(RunStatus(run.status)) if run is not None else None
        if handler is None or run.lease_owner != self.worker_id:
            return False
        started = self.clock.monotonic()
        try:
            more = handler(run, hosts)
            with self._lock:
                if run_id in self._read_limit:  # stored: the next reads may be larger again
                    self._read_limit[run_id] *= 2
                    if self._read_limit[run_id] >= INGEST_READ_BYTES:
                        del self._read_limit[run_id]
        except HostUnreachable as exc:
            with fresh_run(self.db, run_id) as (s, fresh):
                mark_unreachable(s, exc.host, str(exc))
                host_unreachable(s, fresh, str(exc), self.clock.now(), self.settings.unreachable_deadline)
            log.warning("run %s: host unreachable: %s", run_id, exc)
            return False
        except HostError as exc:
            with fresh_run(self.db, run_id) as (s, fresh):
                fail_run(s, fresh, str(exc), self.clock.now())
            log.warning("run %s failed: %s", run_id, exc)
            return False
        except WaitForGpus as exc:
            with fresh_run(self.db, run_id) as (s, fresh):
                wait_for_gpus(s, fresh, str(exc), self.clock.now(), self.settings.gpu_wait_deadline)
            return False
        except Exception as exc:
            if is_store_failure(exc):
                # the database refused a write (a full disk): the job's fate is not this, so nothing is counted
                # against the run; the same step runs again next tick and stores what the host still answers
                # (its outcome included) once the store takes writes again; /healthz says what failed. Its reads
                # are halved meanwhile, so that a backlog larger than the room a refused write frees is stored in
                # pieces that fit, each moving the offsets on, rather than retried whole for ever
                with self._lock:
                    self._read_limit[run_id] = max(MIN_READ_BYTES, self._read_limit.get(run_id, INGEST_READ_BYTES) // 2)
                log.warning("run %s: the database failed, trying again next tick: %s", run_id, str(exc).splitlines()[0][:300])
                return False
            # anything else is a bug or untrusted input gone wrong: counted, and past the rule's limit the run fails
            log.exception("run %s: step failed", run_id)
            with fresh_run(self.db, run_id) as (s, fresh):
                step_failed(s, fresh, f"{type(exc).__name__}: {exc}", self.clock.now())
            return False
        if run.step_failures:
            with fresh_run(self.db, run_id) as (s, fresh):
                step_succeeded(fresh)
        self.contact.mark_answered(hosts.values(), started)
        if not run.host_reachable:
            with fresh_run(self.db, run_id) as (s, fresh):
                host_answering(fresh, self.clock.now())
        return bool(more)

    def forget_all_but(self, run_ids: list[str]) -> None:
        """Drop the sampling clocks and step watches of runs this worker no longer drives."""
        with self._lock:
            self._gpu_sampled = {k: v for k, v in self._gpu_sampled.items() if k in run_ids}
            self._step_watch = {k: v for k, v in self._step_watch.items() if k[0] in run_ids}
            self._read_limit = {k: v for k, v in self._read_limit.items() if k in run_ids}

    def _still_watched(self, run_id: str, attempt: int, step: int | None) -> float:
        """Seconds this worker has seen the attempt's step stand still, by its monotonic clock (from when it first
        saw this step: after a worker restart, from then)."""
        now = self.clock.monotonic()
        with self._lock:
            seen = self._step_watch.get((run_id, attempt))
            if seen is None or seen[0] != step:
                self._step_watch[(run_id, attempt)] = (step, now)
                return 0.0
            return now - seen[1]

    # one handler per state

    def _queue(self, run: Run, hosts: dict[str, Host]) -> bool:
        if run.clean_pending:  # submitted to start fresh over a checkpoint in its output directory: emptied first
            self._clean(run, hosts)
        with fresh_run(self.db, run.id) as (s, fresh):
            start_launching(s, fresh, self.clock.now())
            return fresh.status == RunStatus.LAUNCHING

    def _launch(self, run: Run, hosts: dict[str, Host], views: dict[str, GpuView] | None = None) -> None:
        """Start the current attempt on every node; `views` are GPU snapshots just taken, by host name."""
        attempt = run.current
        for name in dict.fromkeys(run.hosts):
            # before anything is written under it; the agent checks again on the host that it still leads there
            refuse_workspace(self.db, self.contact, hosts[name])
        if not attempt.nodes:
            # record where the attempt lives before anything starts, so a crash cannot orphan it
            placement = [(name, self.contact.layout(hosts[name]).attempt_dir(run.id, attempt.number, i))
                         for i, name in enumerate(run.hosts)]
            with fresh_run(self.db, run.id) as (s, fresh):
                if not is_unchanged(fresh, RunStatus.LAUNCHING, attempt.number):
                    return
                plan_nodes(fresh.current, placement)
                attempt = fresh.current
        nodes = nodes_of(attempt)
        master = _node_address(hosts[run.hosts[0]])
        multi_node = len(nodes) > 1
        # on a Slurm host the scheduler places the job's GPUs, on nodes the login node cannot see
        spec = attempt.typed_spec
        envs = [dict(spec.env) if hosts[node.host].kind == "slurm"
                else self._gpu_env(attempt, hosts[node.host], (views or {}).get(node.host)) for node in nodes]
        answers = []
        for i, (node, env) in enumerate(zip(nodes, envs, strict=True)):
            host = hosts[node.host]
            address = _node_address(host) if multi_node else None
            argv = job_argv(spec, host.python, run.id, node_rank=i, master_addr=master, node_addr=address)
            # a batch job is submitted once; until it starts, each launching step asks again (the same job answers)
            batch = slurm_batch(spec, host.python, run.id, attempt.number) if host.kind == "slurm" else None
            answers.append(self.contact.agent(host).launch(LaunchRequest(
                node.dir, attempt.token, argv, env, spec.cwd, node_address=address, slurm=batch,
                totals=totals_query(spec) if i == 0 and batch is None else None)))
        waiting = [a.queue if a.state == NodeState.PENDING and a.queue else None for a in answers]
        with fresh_run(self.db, run.id) as (s, fresh):
            nodes_launched(attempt_numbered(fresh, attempt.number), [a.pid for a in answers],
                           [visible_devices(env) for env in envs], [asdict(q) if q else None for q in waiting])
            if not is_unchanged(fresh, RunStatus.LAUNCHING, attempt.number):
                return  # cancelled or restarted meanwhile: that handler stops what we started
            if answers[0].totals is not None:
                self._total_found(s, fresh, spec, answers[0].totals)
            queued = next((q for q in waiting if q is not None), None)
            if queued is not None:
                job_queued(fresh, queue_message(queued))
                return
            launched(s, fresh, self.clock.now())

    @staticmethod
    def _total_found(session: Session, run: Run, spec: RunCreate, facts: dict[str, Any]) -> None:
        """A foreign trainer's total steps from what node 0's host read at launch (worker/hostside/totals.py)."""
        found = found_total(spec, facts)
        if found is not None:
            total_found(session, run, run.current, found.steps, found.note)
        else:
            why = facts.get("unreadable") if isinstance(facts.get("unreadable"), str) else "not enough was read"
            total_found(session, run, run.current, None, f"no total steps from the host: {why[:500]}")

    def _gpu_env(self, attempt: Attempt, host: Host, view: GpuView | None = None) -> dict[str, str]:
        """The job's environment with its GPUs placed (worker/gpu_placement.py); raises WaitForGpus.

        Reads nvidia-smi on the host unless given a snapshot just taken there (and stored)."""
        if view is None:
            view = self.contact.agent(host).gpus([attempt.token])
            with self.db.writing() as s:
                store_snapshot(s, host.id, view, self.clock.now())
        return placement_env(attempt.typed_spec, attempt.token, host.name, view)

    def _poll(self, run: Run, hosts: dict[str, Host]) -> bool:
        attempt = run.current
        nodes = nodes_of(attempt)
        limit = self._read_limit.get(run.id, INGEST_READ_BYTES)
        probes = probe_nodes(self.contact, attempt, hosts, with_gpus=self._gpu_sample_due(run.id), limit=limit)
        # a node whose wrapper died is not over while processes of it survive the host's stop of them; a batch job
        # that its scheduler put back in the queue (requeued after a node failure) is not over either
        running = [p for p in probes if p.answer.state in (NodeState.RUNNING, NodeState.PENDING) or p.answer.remaining]
        failed = [p for p in probes if ended_badly(p.answer.state, p.answer.exit_code)]
        if failed and running:
            # one node's failure fails the attempt: stop the others, and look again next tick
            for p in running:
                node = nodes[p.index]
                self.contact.agent(hosts[node.host]).cancel(node.dir, self.settings.cancel_grace)
        drained = not any(p.answer.more for p in probes)
        with fresh_run(self.db, run.id) as (s, fresh):
            store_probes(s, fresh, attempt_numbered(fresh, attempt.number), probes, self.clock.now())
            if not is_unchanged(fresh, RunStatus.RUNNING, attempt.number):
                return False
            if running or not drained:
                current = fresh.current
                stall_seen(s, fresh, self.clock.now(), self.settings.stall_factor, self.settings.stall_floor,
                           self._still_watched(run.id, current.number, current.last_step))
                # files still being read (the host had more than INGEST_READ_BYTES): the next read follows at once,
                # not a tick later, each in a short transaction of its own; so does a job's outcome, waiting only on
                # the reads (at most the log's kept tail: hostside/attempt.py)
                return not drained
            bad = failed[0] if failed else None
            failure = (NodeFailure(nodes[bad.index].host, bad.answer.state, bad.answer.exit_code, bad.answer.note,
                                   time_limit=bad.answer.queue is not None and bad.answer.queue.ended_at_time_limit,
                                   cause=failure_cause.cause(bad.answer.failure, run.name))
                       if bad else None)
            attempt_finished(s, fresh, failure, self.clock.now())
            return fresh.status == RunStatus.LAUNCHING  # a retry

    def _cancel(self, run: Run, hosts: dict[str, Host]) -> None:
        active = [a for a in run.attempts if a.status not in ENDED_ATTEMPT]
        remaining, _ = self.stopper.stop(run, active, hosts, AttemptStatus.CANCELLED, "cancelled on request")
        with fresh_run(self.db, run.id) as (s, fresh):
            cancel_settled(s, fresh, remaining, self.clock.now())

    def _restart(self, run: Run, hosts: dict[str, Host]) -> None:
        # earlier attempts still going, and any given up on while their host was away that may still run there
        old = [a for a in run.attempts if a.number < run.attempt and (a.status not in ENDED_ATTEMPT or a.abandoned)]
        remaining, views = self.stopper.stop(run, old, hosts, AttemptStatus.CANCELLED,
                                             f"superseded by attempt {run.attempt}")
        if remaining:
            with fresh_run(self.db, run.id) as (s, fresh):
                restart_blocked(fresh, remaining)
            return
        if run.clean_pending:
            self._clean(run, hosts)
        with fresh_run(self.db, run.id) as (s, fresh):
            if not restart_cleared(s, fresh, run.attempt, self.clock.now()):
                return
        # launch in this same step, placed by the GPU snapshots the cancels just took with the old attempts gone
        launching, _ = read_run(self.db, run.id)
        if launching is not None and is_unchanged(launching, RunStatus.LAUNCHING, run.attempt):
            self._launch(launching, hosts, views)

    def _clean(self, run: Run, hosts: dict[str, Host]) -> None:
        """Empty the run's output directory on every host; a warm start's draft kept aside first."""
        spec = run.typed_spec
        target, keep = spec.clean_dir, spec.trainer.init_from if spec.trainer else None
        for name in run.hosts:
            refuse_workspace(self.db, self.contact, hosts[name])  # and the agent checks it again there
            stash = keep if keep and self.contact.layout(hosts[name]).holds_records_of(keep, run.id) else None
            self.contact.agent(hosts[name]).clean(target, keep_into=stash)

    def _gpu_sample_due(self, run_id: str) -> bool:
        now = self.clock.monotonic()
        with self._lock:
            if now - self._gpu_sampled.get(run_id, float("-inf")) < self.settings.gpu_sample_interval:
                return False
            self._gpu_sampled[run_id] = now
        return True


def _node_address(host: Host) -> str:
    """The address other nodes of a multi-node run reach this host at."""
    return "127.0.0.1" if host.address == LOCAL_ADDRESS else host.address
