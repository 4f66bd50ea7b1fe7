"""The supervisor loop: claims runs through short database leases and moves each one along.

Every step reads the run, talks to its hosts (one agent call per node and action), then applies
what it learned in one short write transaction that re-checks the run's state, so an API call
that changed the run meanwhile always wins and nothing is applied twice.
"""

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Text, cast, or_, select, update

from server.config import Settings
from server.db import Database
from server.models import Attempt, Host, MetricPoint, Run, utcnow
from server.runs import ENDED_ATTEMPT, get_run, open_attempt
from server.states import ACTIVE, RunStatus, transition
from worker.gpu_placement import WaitForGpus, gpu_holders, gpu_readings, placement_env, visible_devices
from worker.host_agent import AgentError, GpuView, HostAgent, gpu_view
from worker.ingest import store_log, store_log_metrics, store_metrics
from worker.jobs import job_argv
from worker.ssh_transport import AuthError
from worker.transport import HostKeyError, TransportError
from worker.transports import LOCAL_ADDRESS, TransportPool

log = logging.getLogger("longrun.worker")
# how a run's message starts while its host is away; replaced once the host answers again
NOT_ANSWERING = "host not answering"
# node state of an attempt given up on while its host was away: its processes are stopped once the host answers
ABANDONED = "abandoned"
# how often the worker looks for abandoned attempts, and how often a host's last_seen_at is refreshed
ORPHAN_SWEEP_SECONDS = 5.0
SEEN_REFRESH_SECONDS = 10.0


class HostUnreachable(TransportError):
    """A TransportError that names the host that did not answer."""

    def __init__(self, host: str, error: TransportError):
        super().__init__(str(error))
        self.host = host


class _Agent(HostAgent):
    """A HostAgent that names its host in transport errors and notes when the host last answered."""

    def __init__(self, name: str, answered: dict[str, float], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.name, self._answered = name, answered

    def call(self, verb: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        try:
            answer = super().call(verb, payload, timeout)
        except HostUnreachable:
            raise
        except TransportError as exc:
            raise HostUnreachable(self.name, exc) from exc
        self._answered[self.name] = time.monotonic()
        return answer


@dataclass
class NodeProbe:
    index: int
    request: dict[str, Any]
    answer: dict[str, Any]


@dataclass
class Stopped:
    """What cancelling one attempt found, one call per node: pids still alive, last output, GPU snapshots."""

    number: int
    probes: list[NodeProbe]
    left: dict[int, list[int]]  # node index -> pids of the attempt still alive there
    views: dict[str, GpuView]  # host name -> GPU snapshot taken once nothing of the attempt remained there

    @property
    def remaining(self) -> list[int]:
        return sorted(p for pids in self.left.values() for p in pids)


def _abandoned(attempt: Attempt) -> bool:
    return any(n.get("state") == ABANDONED for n in attempt.nodes or [])


class Supervisor:
    def __init__(self, db: Database, settings: Settings, worker_id: str | None = None,
                 transports: TransportPool | None = None, max_parallel: int = 16):
        self.db = db
        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.transports = transports or TransportPool(
            connect_timeout=settings.ssh_connect_timeout, command_timeout=settings.ssh_command_timeout)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="longrun-run")
        self._inflight: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gpu_sampled: dict[str, float] = {}
        # host name -> monotonic time of its last answer (any call through self.agent)
        self._answered: dict[str, float] = {}
        self._next_sweep = 0.0
        self._handlers = {
            RunStatus.QUEUED: self._queue,
            RunStatus.LAUNCHING: self._launch,
            RunStatus.RUNNING: self._poll,
            RunStatus.CANCELLING: self._cancel,
            RunStatus.RESTARTING: self._restart,
        }

    # the loop

    def serve(self) -> None:
        log.info("worker %s started", self.worker_id)
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("worker tick failed")
            self._stop.wait(self.settings.poll_interval)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transports.close_all()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve, name="longrun-worker", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        for run_id in self.claim():
            self._submit(run_id, self.step, run_id)
        with self.db.reading() as s:
            wanted = list(s.scalars(select(Host).where(Host.gpu_wanted_at.is_not(None))))
        for host in wanted:
            self._submit(f"host:{host.name}", self.refresh_host, host)
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + ORPHAN_SWEEP_SECONDS
            for attempt_id in self.abandoned_attempts():
                self._submit(f"orphan:{attempt_id}", self.stop_orphan, attempt_id)

    def _submit(self, key: str, fn: Any, *args: Any) -> None:
        with self._lock:
            if key in self._inflight:
                return
            self._inflight.add(key)
        self._pool.submit(self._guarded, key, fn, *args)

    def claim(self) -> list[str]:
        """Take (or renew) the lease of every active run that no other live worker holds."""
        now = utcnow()
        with self.db.writing() as s:
            free = or_(Run.lease_owner.is_(None), Run.lease_owner == self.worker_id, Run.lease_until < now)
            ids = list(s.scalars(select(Run.id).where(Run.status.in_([str(x) for x in ACTIVE]), free)))
            if ids:
                s.execute(update(Run).where(Run.id.in_(ids)).values(
                    lease_owner=self.worker_id, lease_until=now + timedelta(seconds=self.settings.lease_seconds)))
        # forget the sampling clocks of runs this worker no longer drives
        with self._lock:
            self._gpu_sampled = {k: v for k, v in self._gpu_sampled.items() if k in ids}
        return ids

    def _guarded(self, key: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s: step failed", key)
        finally:
            with self._lock:
                self._inflight.discard(key)

    def refresh_host(self, host: Host) -> None:
        """Answer a request for a fresh GPU snapshot of a host (GET /v1/hosts/{name}/gpus)."""
        try:
            view = self.agent(host).gpus([])
        except (TransportError, HostKeyError, AuthError, AgentError) as exc:
            with self.db.writing() as s:
                fresh = s.get(Host, host.id)
                fresh.reachable, fresh.last_error, fresh.gpu_wanted_at = False, str(exc), None
            return
        with self.db.writing() as s:
            self._store_host_snapshot(s, host.id, view)
            s.get(Host, host.id).gpu_wanted_at = None

    @staticmethod
    def _store_host_snapshot(s: Any, host_id: int, view: GpuView) -> None:
        host = s.get(Host, host_id)
        host.gpu_snapshot, host.gpu_snapshot_at = view.snapshot.to_dict(), utcnow()
        host.reachable, host.last_seen_at, host.last_error = True, utcnow(), None

    def step(self, run_id: str) -> None:
        """Move one run along by one step, whatever state it is in."""
        with self.db.reading() as s:
            run = get_run(s, run_id)
            hosts = {h.name: h for h in s.scalars(select(Host).where(Host.name.in_(run.hosts)))}
        handler = self._handlers.get(RunStatus(run.status))
        if handler is None or run.lease_owner != self.worker_id:
            return
        started = time.monotonic()
        try:
            handler(run, hosts)
        except TransportError as exc:
            self._unreachable(run_id, str(exc), getattr(exc, "host", None))
            return
        except (HostKeyError, AuthError, AgentError) as exc:
            self._fail(run_id, str(exc))
            return
        except WaitForGpus as exc:
            self._wait_for_gpus(run_id, str(exc))
            return
        self._mark_answered(list(hosts.values()), started)
        if not run.host_reachable:
            with self.db.writing() as s:
                fresh = s.get(Run, run_id)
                if fresh.unreachable_since is not None and (fresh.message or "").startswith(NOT_ANSWERING):
                    away = (utcnow() - fresh.unreachable_since).total_seconds()
                    fresh.message = f"host answering again after {away:.0f}s away"
                fresh.host_reachable, fresh.unreachable_since = True, None

    # helpers

    def agent(self, host: Host) -> HostAgent:
        return _Agent(host.name, self._answered, self.transports.get(host), host.workspace, host.python,
                      timeout=self.settings.ssh_command_timeout)

    def _mark_answered(self, hosts: list[Host], since: float) -> None:
        """Hosts that answered since `since` are reachable; their last_seen_at is refreshed now and then."""
        now = utcnow()
        due = [h.id for h in hosts if self._answered.get(h.name, -1.0) >= since and (
            h.reachable is not True or h.last_seen_at is None
            or (now - h.last_seen_at).total_seconds() > SEEN_REFRESH_SECONDS)]
        if due:
            with self.db.writing() as s:
                s.execute(update(Host).where(Host.id.in_(due)).values(reachable=True, last_seen_at=now,
                                                                      last_error=None))

    @staticmethod
    def _mark_unreachable(s: Any, host: str | None, error: str) -> None:
        row = s.scalar(select(Host).where(Host.name == host)) if host else None
        if row is not None:
            row.reachable, row.last_error = False, error

    def _unreachable(self, run_id: str, error: str, host: str | None = None) -> None:
        now = utcnow()
        with self.db.writing() as s:
            self._mark_unreachable(s, host, error)
            run = get_run(s, run_id)
            if run.unreachable_since is None:
                run.unreachable_since = now
            run.host_reachable = False
            waited = (now - run.unreachable_since).total_seconds()
            if waited > self.settings.unreachable_deadline:
                why = (f"host unreachable for {waited:.0f}s (deadline {self.settings.unreachable_deadline:.0f}s): "
                       f"{error}; what is left of it there is stopped once the host answers again")
                for attempt in run.attempts:
                    if attempt.status not in ENDED_ATTEMPT:
                        self._end_attempt(attempt, "failed", None, why)
                        # the job may still run there: mark it, so that the sweep stops it later
                        attempt.nodes = [n if n.get("state") == "exited" else {**n, "state": ABANDONED}
                                         for n in attempt.nodes]
                transition(s, run, RunStatus.FAILED, f"host unreachable for more than "
                           f"{self.settings.unreachable_deadline:.0f}s: {error}")
            else:
                run.message = f"{NOT_ANSWERING} since {run.unreachable_since:%H:%M:%S} UTC: {error}"
        log.warning("run %s: host unreachable: %s", run_id, error)

    def abandoned_attempts(self) -> list[int]:
        """Ids of attempts with nodes given up on while their host was away (see _unreachable)."""
        with self.db.reading() as s:
            return list(s.scalars(select(Attempt.id).where(cast(Attempt.nodes, Text).like(f'%"{ABANDONED}"%'))))

    def stop_orphan(self, attempt_id: int) -> None:
        """Stop what is left of an abandoned attempt on its hosts (cancel is idempotent); retried until done."""
        with self.db.reading() as s:
            row = s.get(Attempt, attempt_id)
            if row is None:
                return
            run = get_run(s, row.run_id)
            hosts = {h.name: h for h in s.scalars(select(Host).where(Host.name.in_(run.hosts)))}
        attempt = next(a for a in run.attempts if a.id == attempt_id)
        # an attempt still in progress belongs to its run's handlers
        if attempt.status not in ENDED_ATTEMPT or not _abandoned(attempt):
            return
        started = time.monotonic()
        try:
            remaining, _ = self._stop_and_drain(run, [attempt], hosts, attempt.status, attempt.message)
        except TransportError as exc:
            with self.db.writing() as s:
                self._mark_unreachable(s, getattr(exc, "host", None), str(exc))
            return
        except (HostKeyError, AuthError, AgentError) as exc:
            log.warning("run %s attempt %s: cannot stop what is left of it: %s", run.id, attempt.number, exc)
            return
        self._mark_answered(list(hosts.values()), started)
        log.info("run %s attempt %s: host answered again; %s", run.id, attempt.number,
                 f"processes {remaining} still alive" if remaining else "no process of it remains")

    def _wait_for_gpus(self, run_id: str, why: str) -> None:
        with self.db.writing() as s:
            run = get_run(s, run_id)
            if run.status != RunStatus.LAUNCHING:
                return
            waited = (utcnow() - run.updated_at).total_seconds()
            if waited > self.settings.gpu_wait_deadline:
                message = f"gave up after {waited:.0f}s waiting for GPUs: {why}"
                self._end_attempt(run.current, "failed", None, message)
                transition(s, run, RunStatus.FAILED, message)
            else:
                run.message = f"waiting for GPUs ({waited:.0f}s of {self.settings.gpu_wait_deadline:.0f}s): {why}"

    def _fail(self, run_id: str, message: str) -> None:
        with self.db.writing() as s:
            run = get_run(s, run_id)
            if run.status in ACTIVE:
                self._end_attempt(run.current, "failed", None, message)
                transition(s, run, RunStatus.FAILED, message)
        log.warning("run %s failed: %s", run_id, message)

    @staticmethod
    def _end_attempt(attempt: Attempt, status: str, exit_code: int | None, message: str | None) -> None:
        if attempt.status in ENDED_ATTEMPT:
            return
        attempt.status, attempt.exit_code, attempt.message, attempt.ended_at = status, exit_code, message, utcnow()

    def _gpu_sample_due(self, run_id: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._gpu_sampled.get(run_id, 0.0) < self.settings.gpu_sample_interval:
                return False
            self._gpu_sampled[run_id] = now
        return True

    def _probe(self, run: Run, attempt: Attempt, hosts: dict[str, Host], with_gpus: bool = False) -> list[NodeProbe]:
        out = []
        for i, node in enumerate(attempt.nodes):
            req = {"metrics_offset": node.get("metrics_offset", 0), "log_offset": node.get("log_offset", 0)}
            answer = self.agent(hosts[node["host"]]).probe(node["dir"], **req,
                                                           gpu_tokens=[attempt.token] if with_gpus else None)
            out.append(NodeProbe(i, req, answer))
        return out

    @staticmethod
    def _store_gpu_sample(s: Any, run: Run, attempt: Attempt, probe: NodeProbe, host: Host) -> None:
        """GPU utilisation and memory of the GPUs this attempt uses, as metrics of the run."""
        view = gpu_view(probe.answer["gpus"])
        Supervisor._store_host_snapshot(s, host.id, view)
        readings = gpu_readings(view, attempt.token, attempt.nodes[probe.index].get("gpus"), probe.index)
        now = utcnow()
        s.add_all(MetricPoint(run_id=run.id, attempt=attempt.number, line=None, name=name, step=attempt.last_step,
                              value=value, time=now) for name, value in readings.items())
        if readings and attempt.number == run.attempt:
            run.latest = {**(run.latest or {}), **readings}

    @staticmethod
    def _apply_probes(s: Any, run: Run, attempt: Attempt, probes: list[NodeProbe]) -> None:
        """Store what the probes read; skipped for a node whose offsets moved since (already stored)."""
        nodes = [dict(n) for n in attempt.nodes]
        for p in probes:
            node, a = nodes[p.index], p.answer
            if (node.get("metrics_offset", 0), node.get("log_offset", 0)) != (
                    p.request["metrics_offset"], p.request["log_offset"]):
                continue
            if p.index == 0 and a["metrics"]:
                store_metrics(s, run, attempt, a["metrics"])
            if p.index == 0:
                # the read ends mid-record only while the job runs or the read was cut short
                store_log_metrics(s, run, attempt, node, a["log"], a["state"] != "running" and not a["more"])
            store_log(s, run.id, attempt.number, p.index, node.get("log_offset", 0), a["log_offset"], a["log"])
            if a.get("gpus"):
                host = s.scalar(select(Host).where(Host.name == node["host"]))
                Supervisor._store_gpu_sample(s, run, attempt, p, host)
            node.update(metrics_offset=a["metrics_offset"], log_offset=a["log_offset"], state=a["state"],
                        exit_code=a["exit_code"])
        attempt.nodes = nodes

    def _stop_attempt(self, attempt: Attempt, hosts: dict[str, Host]) -> Stopped:
        """Cancel every node of the attempt, check that none of its processes holds GPU memory, and read
        what it wrote last: one call per node (the host-side cancel does all three)."""
        stopped = Stopped(attempt.number, [], {}, {})
        for i, node in enumerate(attempt.nodes):
            req = {"metrics_offset": node.get("metrics_offset", 0), "log_offset": node.get("log_offset", 0)}
            answer = self.agent(hosts[node["host"]]).cancel(node["dir"], self.settings.cancel_grace,
                                                            read_from=req, gpu_tokens=[attempt.token])
            left = list(answer["remaining"])
            if not left and answer.get("gpus"):
                view = gpu_view(answer["gpus"])
                if answer["signalled"]:
                    left = gpu_holders(view, attempt.token, set(answer["signalled"]))
                if not left:
                    stopped.views[node["host"]] = view
            if left:
                stopped.left[i] = left
            stopped.probes.append(NodeProbe(i, req, answer["probe"]))
        return stopped

    # one handler per state

    def _queue(self, run: Run, hosts: dict[str, Host]) -> None:
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            if fresh.status == RunStatus.QUEUED:
                transition(s, fresh, RunStatus.LAUNCHING, "launching")

    def _launch(self, run: Run, hosts: dict[str, Host], views: dict[str, GpuView] | None = None) -> None:
        """Start the current attempt on every node; `views` are GPU snapshots just taken, by host name."""
        attempt = run.current
        if not attempt.nodes:
            # record where the attempt lives before anything starts, so a crash cannot orphan it
            attempt.nodes = [{"host": name, "dir": self.agent(hosts[name]).attempt_dir(run.id, attempt.number, i),
                              "metrics_offset": 0, "log_offset": 0, "state": "pending"}
                             for i, name in enumerate(run.hosts)]
            with self.db.writing() as s:
                fresh = get_run(s, run.id)
                if fresh.status != RunStatus.LAUNCHING or fresh.attempt != attempt.number:
                    return
                fresh.current.nodes = attempt.nodes
        master = _node_address(hosts[run.hosts[0]])
        multi_node = len(attempt.nodes) > 1
        envs = [self._gpu_env(attempt, hosts[node["host"]], (views or {}).get(node["host"]))
                for node in attempt.nodes]
        pids = []
        for i, (node, env) in enumerate(zip(attempt.nodes, envs, strict=True)):
            host = hosts[node["host"]]
            address = _node_address(host) if multi_node else None
            argv = job_argv(attempt.spec, host.python, run.id, node_rank=i, master_addr=master, node_addr=address)
            answer = self.agent(host).launch(node["dir"], attempt.token, argv, env, attempt.spec.get("cwd"),
                                             node_address=address)
            pids.append(answer["pid"])
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            current = fresh.current
            current.nodes = [{**n, "pid": pid, "state": "running", "gpus": visible_devices(env)}
                             for n, pid, env in zip(current.nodes, pids, envs, strict=True)]
            if fresh.status != RunStatus.LAUNCHING or fresh.attempt != attempt.number:
                return  # cancelled or restarted meanwhile: that handler stops what we started
            current.status, current.started_at = "running", current.started_at or utcnow()
            transition(s, fresh, RunStatus.RUNNING, f"attempt {attempt.number} running",)

    def _gpu_env(self, attempt: Attempt, host: Host, view: GpuView | None = None) -> dict[str, str]:
        """The job's environment with its GPUs placed (worker/gpu_placement.py); raises WaitForGpus.

        Reads nvidia-smi on the host unless given a snapshot just taken there (and stored)."""
        if view is None:
            view = self.agent(host).gpus([attempt.token])
            with self.db.writing() as s:
                self._store_host_snapshot(s, host.id, view)
        return placement_env(attempt.spec, attempt.token, host.name, view)

    def _poll(self, run: Run, hosts: dict[str, Host]) -> None:
        attempt = run.current
        probes = self._probe(run, attempt, hosts, with_gpus=self._gpu_sample_due(run.id))
        states = [p.answer["state"] for p in probes]
        failed = [p for p in probes if p.answer["state"] in ("lost", "missing") or
                  (p.answer["state"] == "exited" and p.answer["exit_code"] != 0)]
        if failed and "running" in states:
            # one node's failure fails the attempt: stop the others, and look again next tick
            for p in probes:
                if p.answer["state"] == "running":
                    node = attempt.nodes[p.index]
                    self.agent(hosts[node["host"]]).cancel(node["dir"], self.settings.cancel_grace)
        drained = not any(p.answer["more"] for p in probes)
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            current = next(a for a in fresh.attempts if a.number == attempt.number)
            self._apply_probes(s, fresh, current, probes)
            if fresh.status != RunStatus.RUNNING or fresh.attempt != attempt.number:
                return
            if "running" in states or not drained:
                return
            if not failed:
                self._end_attempt(current, "succeeded", 0, None)
                transition(s, fresh, RunStatus.SUCCEEDED, f"attempt {current.number} finished")
                return
            bad = failed[0]
            host = attempt.nodes[bad.index]["host"]
            if bad.answer["state"] == "exited":
                code = bad.answer["exit_code"]
                why = f"exited with code {code} on {host}; see its log"
            else:
                code = None
                why = f"its processes on {host} vanished without an exit code (host restarted, or killed)"
            self._end_attempt(current, "failed", code, f"attempt {current.number} {why}")
            if fresh.retries_used < fresh.max_retries:
                fresh.retries_used += 1
                open_attempt(s, fresh, current.spec, current.number + 1)
                transition(s, fresh, RunStatus.LAUNCHING,
                           f"retry {fresh.retries_used} of {fresh.max_retries}: attempt {current.number} {why}")
            else:
                transition(s, fresh, RunStatus.FAILED, f"attempt {current.number} {why}", exit_code=code)

    def _stop_and_drain(self, run: Run, attempts: list[Attempt], hosts: dict[str, Host],
                        status: str, message: str | None) -> tuple[list[int], dict[str, GpuView]]:
        """Stop these attempts, store their last output, and mark them ended when nothing is left.

        Returns the pids still alive, and per host a GPU snapshot taken once the attempts were gone there."""
        results = [self._stop_attempt(attempt, hosts) for attempt in attempts]
        views: dict[str, GpuView] = {}
        for r in results:
            views.update(r.views)  # a later snapshot of a host also saw the earlier attempts gone
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            for name, view in views.items():
                self._store_host_snapshot(s, hosts[name].id, view)
            for r in results:
                current = next(a for a in fresh.attempts if a.number == r.number)
                self._apply_probes(s, fresh, current, r.probes)
                if not r.remaining:
                    codes = [p.answer["exit_code"] for p in r.probes if p.answer["exit_code"] is not None]
                    self._end_attempt(current, status, codes[0] if codes else None, message)
                elif current.status in ENDED_ATTEMPT:
                    # given up on earlier and still not gone: keep those nodes marked, to be stopped again
                    current.nodes = [{**n, "state": ABANDONED} if i in r.left else n
                                     for i, n in enumerate(current.nodes)]
        return sorted(p for r in results for p in r.remaining), views

    def _cancel(self, run: Run, hosts: dict[str, Host]) -> None:
        active = [a for a in run.attempts if a.status not in ENDED_ATTEMPT]
        remaining, _ = self._stop_and_drain(run, active, hosts, "cancelled", "cancelled on request")
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            if fresh.status != RunStatus.CANCELLING:
                return
            if remaining:
                fresh.message = f"cancelling: processes {remaining} still alive; trying again"
                return
            transition(s, fresh, RunStatus.CANCELLED, "cancelled; no process of the run remains")

    def _restart(self, run: Run, hosts: dict[str, Host]) -> None:
        # earlier attempts still going, and any given up on while their host was away that may still run there
        old = [a for a in run.attempts if a.number < run.attempt and (a.status not in ENDED_ATTEMPT or _abandoned(a))]
        remaining, views = self._stop_and_drain(run, old, hosts, "cancelled", f"superseded by attempt {run.attempt}")
        if remaining:
            with self.db.writing() as s:
                get_run(s, run.id).message = f"restarting: processes {remaining} still alive; trying again"
            return
        if run.clean_pending:
            target = run.spec.get("trainer", {}).get("output_dir") or run.spec.get("output_dir")
            keep = run.spec.get("trainer", {}).get("init_from")
            for name in run.hosts:
                agent = self.agent(hosts[name])
                stash = keep if keep and keep.startswith(f"{agent.workspace}/.longrun/{run.id}/") else None
                agent.clean(target, keep_into=stash)
        with self.db.writing() as s:
            fresh = get_run(s, run.id)
            if fresh.status != RunStatus.RESTARTING or fresh.attempt != run.attempt:
                return
            fresh.clean_pending = False
            transition(s, fresh, RunStatus.LAUNCHING, f"previous attempts stopped; launching attempt {fresh.attempt}")
        # launch in this same step, placed by the GPU snapshots the cancels just took with the old attempts gone
        with self.db.reading() as s:
            launching = get_run(s, run.id)
        if launching.status == RunStatus.LAUNCHING and launching.attempt == run.attempt:
            self._launch(launching, hosts, views)


def _node_address(host: Host) -> str:
    """The address other nodes of a multi-node run reach this host at."""
    return "127.0.0.1" if host.address == LOCAL_ADDRESS else host.address
