import json

from server.db import Database
from server.models import Attempt, MetricPoint, Run
from worker.ingest import store_metrics


def test_replaying_the_same_lines_stores_nothing_twice(db: Database) -> None:
    lines = "".join(json.dumps({"step": i, "total_steps": 3, "time": 1000.0 + i, "loss": 1.0 / i, "acc_0": 0.5})
                    + "\n" for i in range(1, 4))
    with db.writing() as s:
        run = Run(id="r", name="r", status="running", spec={}, hosts=["local"], latest={})
        s.add(run)
        s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    for _ in range(2):
        # a crash after storing but before the offset was saved: the same bytes come again
        with db.writing() as s:
            run, attempt = s.get(Run, "r"), s.query(Attempt).one()
            store_metrics(s, run, attempt, lines)
            attempt.metrics_lines = 0
    with db.reading() as s:
        points = s.query(MetricPoint).filter_by(name="loss").order_by(MetricPoint.step).all()
        assert [p.step for p in points] == [1, 2, 3]
        assert s.query(MetricPoint).count() == 6
        run = s.get(Run, "r")
        assert run.latest["step"] == 3 and run.latest["total_steps"] == 3


def test_garbage_lines_keep_their_place(db: Database) -> None:
    text = '{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": 1.5}\n'
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec={}, hosts=["local"], latest={}))
        s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    with db.writing() as s:
        assert store_metrics(s, s.get(Run, "r"), s.query(Attempt).one(), text) == 4
    with db.reading() as s:
        assert [(p.line, p.step) for p in s.query(MetricPoint).order_by(MetricPoint.line)] == [(0, 1), (3, 3)]
        assert s.query(Attempt).one().metrics_lines == 4
