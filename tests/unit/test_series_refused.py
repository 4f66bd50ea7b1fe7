"""A run that names more series than it takes is told so (docs/reliability.md, "a set of series that grows"):
the names past the bound are not stored, and one `series_refused` event, once per run, says so and names the
first one refused (before: they vanished without a word)."""

from sqlalchemy import select

from server.models import Event
from tests.worker.conftest import Rig, rig  # noqa: F401 - the worker's fixture, shared
from worker.ingest import MAX_SERIES_PER_RUN, SERIES_REFUSED


def test_series_names_past_the_bound_are_said_once_in_the_runs_events(rig: Rig) -> None:  # noqa: F811
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    host.write_metrics(job, *({"step": i, **{f"s{i}_{k}": 1.0 for k in range(250)}} for i in range(1, 6)))
    rig.step(run_id)
    host.write_metrics(job, {"step": 6, "another_new_name": 1.0, "s1_0": 2.0})
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.latest["s1_0"] == 2.0 and "another_new_name" not in run.latest
    with rig.db.reading() as s:
        said = list(s.scalars(select(Event).where(Event.run_id == run_id, Event.kind == SERIES_REFUSED)))
    assert len(said) == 1
    assert said[0].data["limit"] == MAX_SERIES_PER_RUN and said[0].data["first"].startswith("s5_")
    assert "new names are not stored" in said[0].data["message"]
