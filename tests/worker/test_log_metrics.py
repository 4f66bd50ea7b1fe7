"""Progress read from what trainers print: the parser on real trainer output, and its storage exactly once."""

import json
import math
import random
import sys
import time
from pathlib import Path

import pytest

from server.db import Database
from server.models import Attempt, Event, MetricPoint, Run
from server.spec import RunCreate
from worker.host_agent import HostAgent
from worker.ingest import store_log_metrics, store_metrics
from worker.local_transport import LocalTransport
from worker.log_metrics import (
    MAX_STEP,
    RICH_CONTINUATION_RE,
    RICH_HEADER_RE,
    LogMetricsConfig,
    compile_pattern,
    parse_record,
    read_log,
)
from worker.protocol import LaunchRequest, ReadFrom

LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "trainer_logs"
DEFAULT = LogMetricsConfig()


def fixture(name: str) -> str:
    # as the host reads it: bytes decoded with replacement
    return (LOGS / f"{name}.log").read_bytes().decode("utf-8", "replace")


def whole(name: str, config: LogMetricsConfig = DEFAULT) -> list[tuple[int, dict, float | None]]:
    chunk = read_log(fixture(name), 0, False, True, config)
    return [(r.index, r.values, r.step_seconds) for r in chunk.records]


def test_a_tqdm_bar_gives_step_total_rate_and_its_postfix() -> None:
    records = whole("plain_tqdm")
    bars = [v for _, v, seconds in records if "total_steps" in v]
    assert [v["step"] for v in bars] == sorted(v["step"] for v in bars)
    assert bars[-1]["step"] == bars[-1]["total_steps"] == 40
    assert bars[-1]["loss"] == pytest.approx(5.0 / 40, abs=1e-4) and bars[-1]["lr"] == 0.0002
    rates = [seconds for _, v, seconds in records if seconds is not None]
    assert rates and all(0.015 < s < 0.2 for s in rates), "the capture slept 0.02 s per step"
    # tqdm.write lines between redraws carry their own numbers
    written = [v for _, v, _ in records if "grad_norm" in v]
    assert [v["step"] for v in written] == [10, 20, 30, 40] and written[0]["loss"] == 0.5


def test_speculators_rich_log_lines_are_joined_into_one_record_per_step() -> None:
    records = whole("speculators")
    train = [v for _, v, _ in records if "train/loss" in v]
    assert [v["step"] for v in train] == list(range(12)), "global_step, from the last of Rich's wrapped lines"
    assert all(v["train/loss"] == pytest.approx(9.5 / (1 + v["step"]), abs=1e-3) for v in train)
    assert train[0]["train/full_acc_0"] == 0.1 and train[0]["lr"] == 3e-05 and "total_steps" not in train[0]
    assert "trainer.py" not in " ".join(k for v in train for k in v) and "capture.py" not in str(train)
    assert [v["val/loss_epoch"] for _, v, _ in records if "val/loss_epoch" in v] == [2.5, 1.5]


def test_specforge_dict_lines_give_steps_lists_and_keep_nan() -> None:
    records = whole("specforge")
    assert [v["step"] for _, v, _ in records] == [1, 2, 3, 4, 5, 6, 6]
    first = records[0][1]
    assert first["loss"] == 6.0 and first["plosses/2"] == 8.0 and first["perf/optimizer_step_time_s"] == 0.02
    evaluation = records[-1][1]
    assert evaluation["eval/loss"] == 2.0 and evaluation["eval/plosses/0"] == 2.0
    assert math.isnan(evaluation["eval/plosses/1"]), "a nan is read: the ingest shows it (worker/metric_values.py)"


@pytest.mark.parametrize("name", ["plain_tqdm", "speculators", "specforge"])
def test_records_are_numbered_the_same_however_the_reads_cut_the_log(name: str) -> None:
    text = fixture(name)
    expected = whole(name)
    # reads end at a line end (\r or \n), as the host cuts them while the job runs; Rich writes a wrapped
    # record in one go, so a read ends between records, not inside one
    ends = [i + 1 for i, c in enumerate(text) if c in "\r\n" and (
        not RICH_CONTINUATION_RE.match(text[i + 1:i + 30]) or RICH_HEADER_RE.match(text[i + 1:i + 60]))]
    assert len(ends) >= 7
    for cuts in (ends[::3], ends[::7], ends[1::2], ends):
        got, index, midline, start = [], 0, False, 0
        for end in [*cuts, len(text)]:
            if end <= start:
                continue
            chunk = read_log(text[start:end], index, midline, end == len(text), DEFAULT)
            got += [(r.index, r.values, r.step_seconds) for r in chunk.records]
            index, midline, start = index + chunk.consumed, chunk.midline, end
        assert repr(got) == repr(expected)  # repr: a nan equals no nan


def test_a_read_that_ends_inside_a_record_skips_that_record_whole() -> None:
    config = DEFAULT
    first = read_log("step=1 loss=2.0\nstep=2 lo", 0, False, False, config)
    assert [r.values["step"] for r in first.records] == [1] and first.midline and first.consumed == 1
    second = read_log("ss=1.0\nstep=3 loss=0.5\n", first.consumed, first.midline, False, config)
    assert [(r.index, r.values["step"]) for r in second.records] == [(2, 3)]
    final = read_log("step=4 loss=0.25", 3, False, True, config)
    assert [r.values["step"] for r in final.records] == [4], "the job ended: its last unterminated line counts"


def test_lines_that_are_not_progress_give_nothing() -> None:
    for line in ["world size 2, pid 4242, CUDA_VISIBLE_DEVICES=0,1",
                 "config: Namespace(lr=0.001, epochs=1, batch_size=8)",
                 "[23:37:41] INFO     Training epoch 1/2 started                     trainer.py:642",
                 '{"level": "info", "msg": "loading shards", "shards": 4}',
                 "Traceback (most recent call last):", ""]:
        assert parse_record(line, DEFAULT) is None, line


def test_the_bundled_trainers_progress_line_and_hf_trainer_dicts() -> None:
    line = ("[train] step 10/100 epoch 0.10 loss 2.3456 acc 0.50/0.40 lr 3.00e-05 gnorm 0.500 1234 tok/s "
            "eta 0:01:02")
    values, _ = parse_record(line, DEFAULT)
    assert values == {"step": 10, "total_steps": 100, "epoch": 0.1, "loss": 2.3456, "lr": 3e-05, "gnorm": 0.5}
    hf, _ = parse_record("{'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.5}", DEFAULT)
    assert hf == {"loss": 2.31, "grad_norm": 1.2, "learning_rate": 5e-05, "epoch": 0.5}


def test_a_pattern_names_series_by_its_groups() -> None:
    config = LogMetricsConfig(patterns=(compile_pattern(r"it (?P<step>\d+) of (?P<total_steps>\d+) \| objective "
                                                        r"(?P<objective>\S+)"),))
    values, _ = parse_record("it 5 of 60 | objective 0.8000", config)
    assert values == {"step": 5, "total_steps": 60, "objective": 0.8}
    assert parse_record("it 5 of 60 | objective n/a", config)[0] == {"step": 5, "total_steps": 60}
    only_patterns = LogMetricsConfig(formats=frozenset(), patterns=config.patterns)
    assert parse_record("step=3 loss=1.0", only_patterns) is None


@pytest.mark.parametrize(("text", "why"), [("(?P<loss>[0-9.]+", "not a regular expression"),
                                           (r"loss ([0-9.]+)", "named group"), ("x" * 1001, "at most")])
def test_bad_patterns_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        compile_pattern(text)


def test_hostile_output_never_raises_and_gives_only_sane_values() -> None:
    hostile = [
        "\x1b[31mstep=5 loss=1.5\x1b[0m\x1b]0;title\x07",  # colours and a terminal title
        "step=99999999999999999999999 loss=1.0",  # a step past any counter
        f"step={2**63} loss=1.0", f"step={MAX_STEP + 1}/10 loss=2", "step=-3 loss=1",
        "step=1 loss=nan acc=inf lr=-inf grad=1e999 x=" + "9" * 5000,
        "{" * 5000 + "}" * 5000, "[" * 300 + "]" * 300, '{"step": 1e400, "loss": 1}', '{"a": ' * 200,
        "{'loss': 1, 'step': " + "9" * 4400 + "}", "x" * 100_000, "loss=" + "1" * 400,
        "\ufffd\ufffd step=\ufffd loss=\ufffd", "100%|#| 99999999999999999999/5 [00:01<00:00, 1e309it/s]",
        " 50%|#####     | 5/10 [00:01<00:01, 0.00it/s, loss=nan]", "1.5M/3M", "step 7/0 loss 1",
    ]
    rng = random.Random(12)
    alphabet = "step=loss:{}[]'\"0123456789.e-+ /|%\x1b[m\t" + "".join(chr(c) for c in range(0x2580, 0x2590))
    hostile += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200))) for _ in range(3000)]
    text = "\n".join(hostile) + "\r\n\r"
    for config in (DEFAULT, LogMetricsConfig(patterns=(compile_pattern(r"(?P<step>\d+)\D+(?P<loss>\S+)"),))):
        records = read_log(text, 0, False, True, config).records
        for record in records:
            for name, value in record.values.items():
                if name in ("step", "total_steps"):
                    assert isinstance(value, int) and 0 <= value <= MAX_STEP
                else:
                    # a non-finite value is read (the ingest shows it), a finite one within what a column holds
                    assert isinstance(value, float) and len(name) <= 128
                    assert not math.isfinite(value) or abs(value) <= 1e300
            if record.step_seconds is not None:
                assert math.isfinite(record.step_seconds) and record.step_seconds > 0
    assert parse_record(hostile[0], DEFAULT) == ({"step": 5, "loss": 1.5}, None)
    assert parse_record(hostile[1], DEFAULT) == ({"loss": 1.0}, None), "the loss stays, the step does not"


# storage: through worker/ingest.py into a real database


def _add_run(db: Database, spec: dict) -> None:
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec=spec, hosts=["local"], latest={}))
        s.add(Attempt(run_id="r", number=1, spec=spec, token="t", nodes=[{"host": "local"}], metrics_lines=0))


def _ingest_log(db: Database, text: str, complete: bool = False) -> None:
    """One read of the log, as store_probes stores it: the node's counters move in the same transaction."""
    with db.writing() as s:
        run, attempt = s.get(Run, "r"), s.query(Attempt).one()
        node = dict(attempt.nodes[0])
        position = store_log_metrics(s, run, attempt, (node.get("log_records", 0), node.get("log_midline", False)),
                                     text, complete)
        attempt.nodes = [{**node, "log_records": position[0], "log_midline": position[1]}]


def _points(db: Database, name: str) -> list[tuple[int | None, float]]:
    with db.reading() as s:
        return [(p.step, p.value) for p in s.query(MetricPoint).filter_by(name=name).order_by(MetricPoint.id)]


ENTRYPOINT = {"entrypoint": "/opt/train.py", "host": "local"}


def test_log_metrics_are_stored_once_when_the_same_bytes_are_read_again(db: Database, tmp_path: Path) -> None:
    _add_run(db, ENTRYPOINT)
    text = fixture("plain_tqdm")
    half = text.index("\r", len(text) // 2) + 1
    _ingest_log(db, text[:half])
    with db.reading() as s:
        state = dict(s.query(Attempt).one().nodes[0])
    _ingest_log(db, text[half:], complete=True)
    with db.writing() as s:
        # the worker restarted from the older offsets (the read was stored, its offset lost): the bytes come again
        s.query(Attempt).one().nodes = [state]
    _ingest_log(db, text[half:], complete=True)
    # the same log read in one go into a fresh database
    fresh = Database(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    fresh.migrate()
    _add_run(fresh, ENTRYPOINT)
    _ingest_log(fresh, text, complete=True)
    assert _points(db, "loss") == _points(fresh, "loss") and len(_points(db, "loss")) > 40
    steps = [step for step, _ in _points(db, "loss")]
    assert steps == sorted(steps) and steps[-1] == 40
    with db.reading() as s:
        run, attempt = s.get(Run, "r"), s.query(Attempt).one()
        assert attempt.total_steps == 40 and attempt.last_step == 40
        assert 0.015 < attempt.sec_per_step < 0.1, "from tqdm's own rate: the capture slept 0.02 s per step"
        assert run.latest["loss"] == 0.125 and run.latest["grad_norm"] == 0.75


def test_a_metrics_file_replaces_what_was_read_from_the_log(db: Database) -> None:
    _add_run(db, ENTRYPOINT)
    _ingest_log(db, "step 1/3 loss 2.0\nstep 2/3 loss 1.0\n")
    assert _points(db, "loss") == [(1, 2.0), (2, 1.0)]
    lines = "".join(json.dumps({"step": i, "total_steps": 3, "time": 1000.0 + i, "loss": 3.0 - i}) + "\n"
                    for i in (1, 2))
    with db.writing() as s:
        store_metrics(s, s.get(Run, "r"), s.query(Attempt).one(), lines)
    _ingest_log(db, "step 3/3 loss 0.5\n")
    assert _points(db, "loss") == [(1, 2.0), (2, 1.0)], "the metrics file's points, and only those"
    with db.reading() as s:
        assert [p.line for p in s.query(MetricPoint).order_by(MetricPoint.id)] == [0, 1]


def test_the_bundled_trainer_and_an_empty_format_list_read_no_log(db: Database) -> None:
    _add_run(db, {"trainer": {"verifier_path": "/tmp/v", "data_dir": "/tmp/d", "vocab_mapping_dir": "/tmp/m",
                              "output_dir": "/tmp/x"}, "host": "local"})
    _ingest_log(db, "[train] step 1/10 epoch 0.10 loss 2.0\n")
    assert _points(db, "loss") == []
    assert LogMetricsConfig.from_spec(RunCreate.model_validate({**ENTRYPOINT, "log_metrics": {"formats": []}})) is None


def test_a_total_from_the_spec_gives_progress_to_a_log_without_one(db: Database) -> None:
    _add_run(db, {**ENTRYPOINT, "log_metrics": {"total_steps": 12}})
    _ingest_log(db, fixture("speculators"), complete=True)
    with db.reading() as s:
        attempt = s.query(Attempt).one()
        assert attempt.total_steps == 12 and attempt.last_step == 11
    assert [step for step, _ in _points(db, "train/loss")] == list(range(12))
    assert _points(db, "val/loss_epoch") == [(5, 2.5), (11, 1.5)], "a line without a step takes the last one"


def test_a_pattern_that_backtracks_without_end_cannot_hold_the_worker() -> None:
    config = LogMetricsConfig(patterns=(compile_pattern(r"(?P<x>(a|aa)+)$"),))
    text = "".join(f"step={i} loss=1.0 " + "a" * 60 + "!\n" for i in range(2000))
    read = read_log(text, 0, False, False, config)
    # alone, one search of one line takes minutes: the pattern is given up on once its time is spent, and said
    assert read.slow_patterns == [r"(?P<x>(a|aa)+)$"], "the pattern was cut off at its time limit"
    assert [r.values["step"] for r in read.records] == list(range(2000)), "the built-in formats still read every line"


def test_a_full_read_of_a_chatty_log_parses_in_reasonable_time() -> None:
    line = "train:  45%|####5     | 450/1000 [01:23<01:40,  5.43it/s, loss=2.31, lr=3e-05]\r"
    noisy = "[rank0] " + "word " * 50 + "key=value other: thing 1.2.3.4 path/to/file.py:42\n"
    text = (line * 12000 + noisy * 8000)[: 4 << 20]  # the host's largest read
    started = time.monotonic()
    records = read_log(text, 0, False, False, DEFAULT).records
    assert len(records) == 12000 and time.monotonic() - started < 20


def test_the_host_hands_out_a_running_bar_up_to_its_last_redraw(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("bar", 1)
    # a bar that never ends its line while the job runs, and half a redraw still being written
    script = ("import sys, time; sys.stderr.write('\\r 10%|#   | 1/10 [00:01<00:09, 1.00it/s]"
              "\\r 20%|##  | 2/10 [00:02<00:08, 1.00it/s]\\r 30%|##'); sys.stderr.flush(); time.sleep(30)")
    agent.launch(LaunchRequest(d, "tokbar", [sys.executable, "-c", script], {}))
    deadline = time.time() + 20
    while not (probe := agent.probe(d, ReadFrom())).log and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert probe.state == "running" and probe.log.endswith("1.00it/s]\r"), probe.log
        chunk = read_log(probe.log, 0, False, False, DEFAULT)
        assert [r.values["step"] for r in chunk.records] == [1, 2] and not chunk.midline
    finally:
        agent.cancel(d, grace=2)


def test_a_pattern_that_backtracks_without_end_leaves_the_others_their_time_and_is_said_once(db: Database) -> None:
    bad, good = r"(?P<x>(a|aa)+)$", r"probe (?P<step>\d+) score=(?P<score>\S+)"
    _add_run(db, {**ENTRYPOINT, "log_metrics": {"formats": [], "patterns": [bad, good]}})
    lines = [f"probe {i} score={i / 1000} " + "a" * 60 + "!\n" for i in range(2000)]
    for start in range(0, 2000, 1000):  # two reads of the log
        _ingest_log(db, "".join(lines[start:start + 1000]))
    assert [step for step, _ in _points(db, "score")] == list(range(2000)), "the good pattern read every line"
    with db.reading() as s:
        events = [e.data for e in s.query(Event).filter_by(run_id="r", kind="log_pattern_slow")]
    assert len(events) == 1 and events[0]["pattern"] == bad and "left out of the rest" in events[0]["message"]
