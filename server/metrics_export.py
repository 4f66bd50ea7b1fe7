"""Prometheus metrics, read from the database at scrape time: every server sharing the database answers the same."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from server import queries, views
from server.db import Database
from server.lifecycle import RunStatus
from server.models import Attempt, Host, MetricPoint, Run
from server.series import GPU_SERIES, GpuSeries


class LongrunCollector(Collector):
    """Runs by state, attempts started, retries, host reachability, metric points ingested, and per running
    run its step rate, progress, ETA and GPU utilisation."""

    def __init__(self, db: Database):
        self.db = db

    def collect(self) -> Iterator[Metric]:
        with self.db.reading() as session:
            yield from self._totals(session)
            yield from self._running_runs(session)

    def _totals(self, session: Session) -> Iterator[Metric]:
        by_state = dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).all())
        runs = GaugeMetricFamily("longrun_runs", "Runs in each state.", labels=["state"])
        for state in RunStatus:
            runs.add_metric([state.value], by_state.get(state.value, 0))
        yield runs
        started = session.scalar(select(func.count()).select_from(Attempt).where(Attempt.started_at.is_not(None)))
        yield CounterMetricFamily("longrun_attempts_started", "Attempts that started on their hosts.", value=started)
        retries = session.scalar(select(func.coalesce(func.sum(Run.retries_used), 0)))
        yield CounterMetricFamily("longrun_retries", "Attempts opened by the retry rule after a failure.",
                                  value=retries)
        points = session.scalar(select(func.count()).select_from(MetricPoint))
        yield CounterMetricFamily("longrun_metric_points_ingested", "Metric points stored from jobs.", value=points)
        reachable = GaugeMetricFamily("longrun_host_reachable",
                                      "1 when the host answered its last contact, 0 when not; absent before any.",
                                      labels=["host"])
        for name, ok in session.execute(select(Host.name, Host.reachable).where(Host.reachable.is_not(None))):
            reachable.add_metric([name], 1 if ok else 0)
        yield reachable

    def _running_runs(self, session: Session) -> Iterator[Metric]:
        labels = ["run_id", "run_name"]
        step_rate = GaugeMetricFamily("longrun_run_steps_per_second", "Measured training steps per second.",
                                      labels=labels)
        progress = GaugeMetricFamily("longrun_run_progress_ratio", "Last step over total steps (0 to 1).",
                                     labels=labels)
        eta = GaugeMetricFamily("longrun_run_eta_seconds", "Predicted seconds until the run finishes.",
                                labels=labels)
        gpu = GaugeMetricFamily("longrun_run_gpu_utilization_percent",
                                "Utilisation of each GPU the run's current attempt uses.",
                                labels=[*labels, "node", "gpu"])
        running = list(session.scalars(select(Run).where(Run.status == RunStatus.RUNNING)
                                       .options(selectinload(Run.attempts))))
        history = queries.pace_history_for(session, running)
        for run in running:
            key = [run.id, run.name]
            if run.current.sec_per_step:
                step_rate.add_metric(key, 1.0 / run.current.sec_per_step)
            run_progress, run_eta = views.progress_and_eta(run, history)
            if run_progress is not None:
                progress.add_metric(key, run_progress)
            if run_eta is not None:
                eta.add_metric(key, run_eta)
            for name, value in (run.latest or {}).items():
                match = GPU_SERIES.match(name)
                if match and match["kind"] == GpuSeries.UTIL and isinstance(value, int | float):
                    gpu.add_metric([*key, match["node"] or "0", match["gpu"]], value)
        yield from (step_rate, progress, eta, gpu)


def registry_for(db: Database) -> CollectorRegistry:
    """A registry of its own (not the process default) holding only the database's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LongrunCollector(db))
    return registry
