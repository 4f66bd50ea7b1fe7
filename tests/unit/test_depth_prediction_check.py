"""The depth experiment's check of the retrain rule (benchmarks/depth_experiment.py): each restart a draft's advice
predicts, against the deeper draft the experiment trained, with the miss flagged past 10 %."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("depth_experiment", ROOT / "benchmarks" / "depth_experiment.py")
depth_experiment = importlib.util.module_from_spec(spec)
spec.loader.exec_module(depth_experiment)


def _draft(ttt: int, taus: list[float], tokens_per_second: list[float], frontier: list[dict],
           suggested: int | None, conditional: list[float] | None = None) -> dict:
    by_depth = [{"depth": d + 1, "tokens_per_second": t} for d, t in enumerate(tokens_per_second)]
    advice = {"tokens_per_second": max(tokens_per_second), "by_depth": by_depth,
              "retrain": {"frontier": frontier, "suggested_ttt_steps": suggested}}
    conditional = conditional or [0.5] * len(taus)
    evaluation = {"by_depth": [{"mean_accepted": t} for t in taus], "conditional_acceptance": conditional,
                  "position_rounds": [100] * len(taus)}
    return {"ttt": ttt, "regenerated": False, "evaluation": evaluation, "advice": {"nvlink": advice, "pcie": advice}}


def test_each_predicted_restart_is_set_against_the_deeper_draft_measured_at_the_depth_it_would_serve() -> None:
    taus3 = [1.5 + 0.05 * d for d in range(16)]
    taus5 = [1.5 + 0.08 * d for d in range(16)]
    ttt3 = _draft(3, taus3, [100.0] * 4 + [90.0] * 12,
                  [{"ttt": 5, "depth": 6, "tokens_per_second": 130.0, "gain": 0.30},
                   {"ttt": 7, "depth": 8, "tokens_per_second": 140.0, "gain": 0.40}], suggested=5)
    ttt5 = _draft(5, taus5, [100.0] * 5 + [125.0] + [110.0] * 10, [], suggested=None)
    rows = depth_experiment.prediction_check([ttt3, ttt5])

    # TTT=7 was not trained: nothing to check it against; one row per interconnect for 3 -> 5
    assert [(r["interconnect"], r["from_ttt"], r["to_ttt"]) for r in rows] == [("nvlink", 3, 5), ("pcie", 3, 5)]
    row = rows[0]
    assert row["proposed"] and row["depth"] == 6
    assert row["measured_tokens_per_second"] == 125.0  # the TTT=5 draft at depth 6, where the rule would serve it
    assert abs(row["miss"] - (130.0 / 125.0 - 1)) < 1e-9 and abs(row["measured_gain"] - 0.25) < 1e-9
    assert row["tau_from_to"] == {d: (taus3[d - 1], taus5[d - 1]) for d in (4, 8, 12, 16)}

    lines = [x for x in depth_experiment.prediction_table(rows) if x.startswith("| as written")]
    assert "| +4.0% |" in lines[0] and "✗" not in lines[0]  # 4 % is within the 10 % the proposal may act on
    rows[0]["miss"] = 0.25
    assert "| +25.0% ✗ |" in depth_experiment.prediction_table(rows)[-2]

    # the rows as server/advisor/rule_record.py takes them, and how the proposal then judges a 3 -> 5 restart
    from server.advisor import rule_record

    record = tuple(eval(line.strip().rstrip(","), {"Checked": rule_record.Checked})  # noqa: S307 - our own output
                   for line in depth_experiment.record_lines(rows, "toy"))
    assert [(c.interconnect, c.from_ttt, c.to_ttt, c.miss) for c in record] == [("nvlink", 3, 5, 0.25),
                                                                                 ("pcie", 3, 5, round(130 / 125 - 1, 4))]
    assert rule_record.judge(3, 5, "nvlink", record)[0] is False and rule_record.judge(3, 5, "pcie", record)[0] is True


def test_the_record_printed_from_results_carries_its_bounds_and_the_held_out_pairs_error(tmp_path) -> None:
    """`--record RESULTS`: the rows to paste into rule_record.py, DEEPEST_MEASURED (the deepest TTT a checked restart
    reached), HIGHEST_ACCEPTANCE (the best a deeper draft measured past the shallower one's TTT, up to its own), and
    what the rule predicted for the held-out pair against what was measured, with the record's verdict without it."""
    import json

    from server.advisor import rule_record

    frontier = [{"ttt": 5, "depth": 5, "tokens_per_second": 130.0, "gain": 0.30},
                {"ttt": 8, "depth": 8, "tokens_per_second": 150.0, "gain": 0.50}]
    ttt3 = _draft(3, [1.5] * 12, [100.0] * 12, frontier, suggested=5)
    ttt5 = _draft(5, [1.6] * 12, [120.0] * 12, [], suggested=None,
                  conditional=[0.6, 0.5, 0.5, 0.7, 0.75, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    ttt8 = _draft(8, [1.7] * 12, [100.0] * 12, [], suggested=None,
                  conditional=[0.6, 0.5, 0.5, 0.72, 0.7, 0.7, 0.7, 0.7, 0.95, 0.9, 0.9, 0.9])
    drafts = [ttt3, ttt5, ttt8]
    rows = depth_experiment.prediction_check(drafts)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"args": {"ttt": "3,5,8", "steps": "600", "samples": "32", "max_depth": "12"},
                                   "verifier_name": "smollm2-135m-instruct", "device": "NVIDIA H100 80GB HBM3",
                                   "date": "2026-12-08", "drafts": drafts, "prediction_check": rows}))
    text = depth_experiment.record_text(results, (3, 8))

    assert "DEEPEST_MEASURED = 8\n" in text
    # positions 4..5 of TTT=5 and 4..8 of TTT=8 (past TTT=3): 0.75 at position 5 of TTT=5; position 9's 0.95 is
    # past what TTT=8 trained
    assert "HIGHEST_ACCEPTANCE = 0.75  # TTT=5, position 5" in text
    assert 'SMOLLM2_SOURCE = "the depth experiment on smollm2-135m-instruct of 2026-12-08 (NVIDIA H100' in text
    pasted = text[text.index("SMOLLM2: tuple"):]
    record = tuple(eval(line.strip().rstrip(","), {"Checked": rule_record.Checked})  # noqa: S307 - our own output
                   for line in pasted.splitlines()[1:] if line.startswith("    Checked("))
    assert {(c.from_ttt, c.to_ttt) for c in record} == {(3, 5), (3, 8)}
    # 3 -> 8 held out: predicted +50 %, measured 0 % (150 against 100 tokens/s): a +50 % error, while the record
    # without it (3 -> 5: 130 against 120, +8.3 %) would have trusted that restart
    held = [line for line in text.splitlines() if line.startswith("# held out")]
    assert len(held) == 2 and "prediction error +50.0%" in held[0] and "the record without it: trusted" in held[0]
