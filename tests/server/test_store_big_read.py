"""A run of millions of stored points read whole from a real `longrun serve` (docs/reliability.md, "a run of a
million points"): an answer holds at most 20,000 points and says where the next starts, so the server's memory
does not grow with what is read, also with four readers at once (before: `limit=1000000` was one answer, +838 MiB
and 65 s for 1M points; four at once 2.55 GB). 250,000 points by default: one unpaged answer of them would cost a
reader about 200 MiB, so four at once would pass the limit many times over, while the read takes a quarter of the
CPU of 1M (97 s of the integration lane); LONGRUN_BIG_READ_POINTS=1000000 reads the million of docs/reliability.md,
and benchmarks/bench_metrics_read.py is the same at 10M points."""

import os
import threading
from pathlib import Path

import pytest

from longrun import Client
from tests.bulk_points import ended_run, rss_mib, store_points
from tests.service import Service

pytestmark = [pytest.mark.slow, pytest.mark.sqlite_only]

POINTS = int(os.environ.get("LONGRUN_BIG_READ_POINTS", 250_000))
READERS = 4
RSS_LIMIT_MIB = 300


def test_a_run_of_many_points_read_whole_by_four_readers_keeps_the_server_under_300_mib(
        tmp_path: Path, sqlite_template: Path) -> None:
    path = tmp_path / "longrun.db"
    path.write_bytes(sqlite_template.read_bytes())
    url = f"sqlite:///{path}"
    run_id = ended_run(url)
    assert store_points(path, run_id, ["loss"], POINTS) == POINTS
    svc = Service(tmp_path / "home", database_url=url)
    svc.home.mkdir()
    svc.start()
    try:
        pid = svc.proc.pid
        before, _ = rss_mib(pid)
        whole = svc.client.get(f"/v1/runs/{run_id}/metrics", params={"names": "loss", "limit": 1_000_000})
        assert whole.status_code == 422 and whole.json()["detail"][0]["loc"] == ["query", "limit"], whole.text
        thinned = svc.series(run_id, "loss")  # the page's read
        assert len(thinned) <= 2000 and (thinned[0]["step"], thinned[-1]["step"]) == (1, POINTS)
        counts: list[int] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                with Client(svc.url, timeout=300) as client:
                    steps = [p["step"] for p in client.metrics(run_id, names=["loss"], limit=POINTS)["loss"]]
                assert steps == list(range(1, POINTS + 1))
                counts.append(len(steps))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        readers = [threading.Thread(target=read) for _ in range(READERS)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert not errors, errors[0]
        assert counts == [POINTS] * READERS
        now, peak = rss_mib(pid)
        print(f"{POINTS} points read {READERS}x: server RSS {before:.0f} MiB before, {now:.0f} after, peak {peak:.0f}")
        assert peak < RSS_LIMIT_MIB, f"the server's peak RSS was {peak:.0f} MiB ({before:.0f} MiB before the reads)"
    finally:
        svc.stop()
