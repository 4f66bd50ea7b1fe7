"""The trainer's log says an ETA in one format, the one `longrun watch` and the page use."""

from longrun.views import duration as command_duration
from trainer.timefmt import duration


def test_the_training_line_and_the_command_write_an_eta_alike() -> None:
    from trainer.metrics import progress_line  # imports torch: here, not at collection

    record = {"step": 20, "total_steps": 100, "epoch": 0.2, "loss": 1.5, "ttt_steps": 2, "acc_0": 0.5, "acc_1": 0.4,
              "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1000.0}
    assert progress_line(record, 252.0).endswith(" ETA 4m 12s")
    for seconds in (0, 7.4, 59.6, 61, 3599, 3600, 5025, 86399, 90061, 10 * 86400):
        assert duration(seconds) == command_duration(seconds), seconds
