"""The worker: small services under one loop, their work run on a thread pool.

- LeaseClaimer (worker/lease_claimer.py): which runs this worker drives;
- RunDriver (worker/run_driver.py): one step of each of them;
- GpuSnapshotResponder (worker/gpu_responder.py): fresh GPU snapshots the API asked for;
- InterconnectResponder (worker/interconnect.py): all-reduce probes the API asked for;
- OrphanReaper (worker/orphan_reaper.py): what is left of attempts given up on while their host was away;
- WebhookNotifier (worker/notifier.py): webhooks on run state changes, when LONGRUN_WEBHOOK_URL is set;
- ConnectionWarmer (worker/connection_warmer.py): each host's connection opened before its first command, and its
  workspace resolved there before anything is written under it (worker/workspace_check.py: one leading to / is
  refused).

A piece of work is keyed (the run, the host, the attempt), and a key runs at most once at a time. Between ticks
the loop waits on a wake-up from the API (server/wakeup.py), so a request is acted on at once; a key found
still running on a wake-up runs again as soon as it is done, and so does a run step that left more to do now.
"""

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from server.config import Settings
from server.db import Database, is_store_failure
from server.wakeup import WakeupListener
from worker.attempt_stopper import AttemptStopper
from worker.clock import Clock
from worker.connection_warmer import ConnectionWarmer
from worker.gpu_responder import GpuSnapshotResponder
from worker.host_contact import HostContact
from worker.interconnect import InterconnectResponder
from worker.lease_claimer import LeaseClaimer
from worker.notifier import WebhookNotifier
from worker.orphan_reaper import OrphanReaper
from worker.run_driver import RunDriver
from worker.transport_pool import TransportPool
from worker.workspace_check import check_workspace

log = logging.getLogger("longrun.worker")


class Supervisor:
    def __init__(self, db: Database, settings: Settings, worker_id: str | None = None,
                 transports: TransportPool | None = None, max_parallel: int = 16, clock: Clock | None = None):
        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.transports = transports or TransportPool(
            connect_timeout=settings.ssh_connect_timeout, command_timeout=settings.ssh_command_timeout)
        clock = clock or Clock()
        contact = HostContact(db, self.transports, settings.ssh_command_timeout, clock)
        stopper = AttemptStopper(db, contact, settings.cancel_grace, clock)
        self.claimer = LeaseClaimer(db, self.worker_id, settings.lease_seconds, clock)
        self.driver = RunDriver(db, settings, contact, stopper, self.worker_id, clock)
        self.responder = GpuSnapshotResponder(db, contact, clock)
        self.interconnect = InterconnectResponder(db, contact, clock)
        self.reaper = OrphanReaper(db, contact, stopper, clock)
        self.notifier = WebhookNotifier(db, settings) if settings.webhook_url else None
        self.warmer = ConnectionWarmer(db, self.transports, partial(check_workspace, db, contact))
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="longrun-run")
        self.wakeup = WakeupListener(db.engine)
        self._inflight: set[str] = set()
        # keys asked for again while in flight: run again once done
        self._again: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def serve(self) -> None:
        log.info("worker %s started", self.worker_id)
        woken = False
        while not self._stop.is_set():
            try:
                self.tick(woken)
            except Exception as exc:
                if is_store_failure(exc):  # a full or unreachable store: one line a tick, not a traceback
                    log.warning("worker tick: the database failed, trying again next tick: %s",
                                str(exc).splitlines()[0][:300])
                else:
                    log.exception("worker tick failed")
            woken = self.wakeup.wait(self.settings.poll_interval)
        self.close()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve, name="longrun-worker", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        self.wakeup.wake()

    def close(self) -> None:
        """Wait for the work in hand, drop queued work, and close every host connection."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transports.close_all()
        self.wakeup.close()
        if self.notifier:
            self.notifier.close()

    def tick(self, woken: bool = False) -> None:
        """Ask each service for its work once, and hand the work to the pool; `woken`: the API changed something,
        so work in flight (which may have read the state before the change) runs again once done."""
        run_ids = self.claimer.run_once()
        self.driver.forget_all_but(run_ids)
        for run_id in run_ids:
            self._submit(run_id, self.driver.step, run_id, again=woken)
        for host in self.responder.run_once():
            self._submit(f"host:{host.name}", self.responder.answer, host, again=woken)
        for host in self.interconnect.run_once():
            self._submit(f"interconnect:{host.name}", self.interconnect.answer, host, again=woken)
        if self.reaper.due():
            for attempt_id in self.reaper.run_once():
                self._submit(f"orphan:{attempt_id}", self.reaper.stop, attempt_id)
        for host in self.warmer.run_once():
            self._submit(f"connect:{host.name}", self.warmer.warm, host)
        if self.notifier:
            self.notifier.run_once()  # only reads and queues: its own thread posts

    def _submit(self, key: str, work: Callable[..., bool | None], *args: Any, again: bool = False) -> None:
        with self._lock:
            if key in self._inflight:
                if again:
                    self._again.add(key)
                return
            self._inflight.add(key)
        self._pool.submit(self._guarded, key, work, *args)

    def _guarded(self, key: str, work: Callable[..., bool | None], *args: Any) -> None:
        more = False
        try:
            more = bool(work(*args))
        except Exception:
            log.exception("%s: step failed", key)
        finally:
            with self._lock:
                rerun = (more or key in self._again) and not self._stop.is_set()
                self._again.discard(key)
                if not rerun:
                    self._inflight.discard(key)
        if rerun:
            self._pool.submit(self._guarded, key, work, *args)
