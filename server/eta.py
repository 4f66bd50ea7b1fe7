"""Progress, ETA and the restart dry run: plain arithmetic over measured step times."""

from dataclasses import dataclass

from server.log_patterns import setting_from_arguments
from server.spec import RunCreate

# the smoothing weight of the newest step-time sample
EMA_WEIGHT = 0.1
# fixed work per optimiser step (verifier targets, feature fusion, optimiser) in units of one TTT step
TTT_FIXED_COST = 1.0


def update_step_rate(sec_per_step: float | None, last_step: int | None, last_time: float | None,
                     step: int, time: float) -> float | None:
    """Fold one (step, time) observation into the smoothed seconds per step: the mean over the steps since the last
    one, weighted as that many samples of one step each."""
    if last_step is None or last_time is None or step <= last_step or time <= last_time:
        return sec_per_step
    return fold_step_time(sec_per_step, (time - last_time) / (step - last_step), step - last_step)


def fold_step_time(sec_per_step: float | None, sample: float, steps: int = 1) -> float:
    """Fold one measured seconds-per-step sample (from step times, or a progress bar's rate), the mean over `steps`
    steps, into the average: as `steps` samples of one step would be (a read of lines without a time that spans
    25 steps weighs as much as 25 timed lines, not as one)."""
    if sec_per_step is None:
        return sample
    weight = 1 - (1 - EMA_WEIGHT) ** steps
    return weight * sample + (1 - weight) * sec_per_step


def remaining_seconds(total_steps: int | None, step: int | None, sec_per_step: float | None,
                      seconds_since_last: float = 0.0, wrapup_seconds: float = 0.0) -> float | None:
    """The steps left at the measured pace, then `wrapup_seconds` after the last one (the final validation,
    evaluation and export, as an earlier attempt took them and the dry run counts them), less the time since the
    last step: after the last step the ETA counts down through the wrap-up instead of standing at 0."""
    if total_steps is None or step is None or sec_per_step is None:
        return None
    left = max(0, total_steps - step) * sec_per_step + max(0.0, wrapup_seconds)
    return max(0.0, left - max(0.0, seconds_since_last))


def ttt_of(spec: RunCreate) -> int | None:
    return spec.ttt_steps


def _trainer_setting(spec: RunCreate, name: str) -> int | None:
    """The bundled trainer's setting, or an entrypoint run's as its arguments name it (a restart of
    `speculators train --epochs 3` with `--epochs 6` is priced at twice the steps)."""
    return getattr(spec.trainer, name) if spec.trainer else setting_from_arguments(spec.args, name)


@dataclass(frozen=True)
class Measured:
    """One earlier attempt's measured pace."""

    spec: RunCreate
    sec_per_step: float
    total_steps: int
    startup_seconds: float = 0.0
    wrapup_seconds: float = 0.0  # after the last step: final validation, evaluation, export (finished attempts)
    # the trainer's own split of a compiled step (trainer/step_timing.py): fixed seconds + seconds per TTT iteration
    step_fixed_s: float | None = None
    ttt_iter_s: float | None = None


def step_cost_model(measured: list[Measured]) -> tuple[float, float, str]:
    """Seconds per step as a + b*T. Two attempts at different TTT depths fit it; one is scaled."""
    newest = measured[0]
    if newest.ttt_iter_s and newest.step_fixed_s is not None:
        return newest.step_fixed_s, newest.ttt_iter_s, (
            f"timed by the trainer over compiled steps: {newest.step_fixed_s:.4f} s fixed + {newest.ttt_iter_s:.4f} s "
            "per TTT iteration (step_fixed_s, ttt_iter_s)")
    by_ttt: dict[int, float] = {}
    for m in measured:
        t = ttt_of(m.spec)
        if t is not None:
            by_ttt.setdefault(t, m.sec_per_step)
    if len(by_ttt) >= 2:
        (t1, s1), (t2, s2) = sorted(by_ttt.items())[-2:]
        b = (s2 - s1) / (t2 - t1)
        if b > 0:
            return s1 - b * t1, b, f"fitted from measured steps at TTT={t1} and TTT={t2}"
    m = measured[0]
    t = ttt_of(m.spec) or 1
    b = m.sec_per_step / (t + TTT_FIXED_COST)
    return b * TTT_FIXED_COST, b, (f"measured {m.sec_per_step:.3f} s/step at TTT={t}, each TTT step taken "
                                   f"as one more draft forward+backward ({TTT_FIXED_COST:g} step of fixed work)")


def predict_duration(measured: list[Measured], new_spec: RunCreate, done_steps: int = 0) -> tuple[float | None, str]:
    """Predicted seconds for an attempt with `new_spec`, from the newest measured attempts; one that resumes a
    checkpoint at step `done_steps` runs only the steps after it."""
    if not measured:
        return None, "no step has been measured yet for this run or a similar one on this host"
    latest = measured[0]
    old_ttt, new_ttt = ttt_of(latest.spec), ttt_of(new_spec)
    notes = []
    if old_ttt is not None and new_ttt is not None:
        a, b, how = step_cost_model(measured)
        sec = a + b * new_ttt
        notes.append(how)
    else:
        sec = latest.sec_per_step
        notes.append(f"measured {sec:.3f} s/step")
    steps = float(latest.total_steps)
    # data parallel: the same samples over more processes make proportionally fewer steps
    old_n, new_n = latest.spec.nproc_per_node, new_spec.nproc_per_node
    old_nodes, new_nodes = len(latest.spec.host_names), len(new_spec.host_names)
    if old_n * old_nodes != new_n * new_nodes:
        steps *= (old_n * old_nodes) / (new_n * new_nodes)
        notes.append(f"steps scaled for {new_n * new_nodes} processes instead of {old_n * old_nodes}")
    old_epochs, new_epochs = _trainer_setting(latest.spec, "epochs"), _trainer_setting(new_spec, "epochs")
    old_max, new_max = _trainer_setting(latest.spec, "max_steps"), _trainer_setting(new_spec, "max_steps")
    if old_epochs and new_epochs and old_epochs != new_epochs:
        steps *= new_epochs / old_epochs
        notes.append(f"steps scaled for {new_epochs} epochs instead of {old_epochs}")
    if old_max != new_max and new_max:
        steps = min(steps, new_max) if old_max else float(new_max)
    seq_old, seq_new = _trainer_setting(latest.spec, "max_seq_len"), _trainer_setting(new_spec, "max_seq_len")
    if seq_old and seq_new and seq_old != seq_new:
        sec *= seq_new / seq_old
        notes.append(f"step time scaled for max_seq_len {seq_new} instead of {seq_old}")
    if done_steps:
        notes.append(f"resumes at step {done_steps} of {round(steps)}")
        steps = max(steps - done_steps, 0.0)
    startup, wrapup = latest.startup_seconds, latest.wrapup_seconds
    wrap = f" + {wrapup:.0f}s after the last step (validation, evaluation, export)" if wrapup >= 0.5 else ""
    return startup + steps * sec + wrapup, (f"{startup:.0f}s start-up + {round(steps)} steps x {sec:.3f} s/step"
                                            f"{wrap}; " + "; ".join(notes))
