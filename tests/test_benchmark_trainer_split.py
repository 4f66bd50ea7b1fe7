"""benchmarks/bench_trainer.py reports the trainer's own split of a step (trainer/step_timing.py) and, for each
later TTT at a sequence length, the step time that split predicts against the one measured: the figure the restart
dry run's step times are checked by on a GPU (`--shape kimi-k2 2048x3 2048x5 2048x10`). Here at the tiny size on
the CPU, where only the shape of the answer is checked."""

import importlib.util
import json
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("bench_trainer", Path(__file__).resolve().parents[1] / "benchmarks"
                                              / "bench_trainer.py")
bench_trainer = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_trainer)


def test_the_split_of_the_first_cell_predicts_the_deeper_ones(capsys) -> None:
    bench_trainer.main(["--tiny", "32x2", "32x4", "--steps", "1", "--warmup", "1"])
    first, deeper = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["ttt_iter_ms"] > 0 and first["step_fixed_ms"] >= 0 and "predicted_ms_per_step" not in first
    predicted = first["step_fixed_ms"] + 4 * first["ttt_iter_ms"]
    assert deeper["predicted_ms_per_step"] == round(predicted, 2)
    assert abs(deeper["prediction_error"] - (deeper["predicted_ms_per_step"] / deeper["ms_per_step"] - 1)) < 1e-3
