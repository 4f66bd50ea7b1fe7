"""What a restart's new attempt starts from: the bundled trainer resumes the newest checkpoint in its output
directory unless the restart cleans it, so a restart without `clean` continues where the checkpoints are, at
whatever TTT depth they were trained with. This says so before it happens, for the dry run to show and price.

The checkpoint is the trainer's (trainer/checkpoint.py): every `save_every` steps and at each epoch's end, never
on SIGTERM; its step is inferred from the attempts' measured last steps, so it is what the trainer will find
unless files were changed by hand.

Resuming a checkpoint trained at another TTT depth is only done when the restart says `resume` (a depth change
without it is refused, naming the checkpoint's step and depth): otherwise a TTT=3 -> 5 restart would quietly
continue the TTT=3 training from its checkpoint while the user expected a TTT=5 training from step 0."""

from dataclasses import dataclass

from server.errors import FieldError
from server.models import Run
from server.spec import RunCreate, TrainerSpec


@dataclass(frozen=True)
class StartPlan:
    start: str  # "resume", "fresh" or "unknown"
    from_step: int | None  # the checkpoint's step when it resumes
    trained_ttt: int | None  # the TTT depth that checkpoint was trained with
    why: str
    # it resumes a checkpoint trained at another TTT depth than the new attempt's: asked for explicitly (resume)
    other_depth: bool = False
    # the steps the new attempt would train in all, when the checkpoint's attempt told it (None: unknown)
    total_steps: int | None = None


def checkpoint_step(attempt_spec: RunCreate, last_step: int | None, total_steps: int | None) -> int:
    """The last step at which the trainer of this attempt saved a checkpoint, 0 for none."""
    if not last_step:
        return 0
    trainer = attempt_spec.trainer
    every = (trainer.save_every if trainer else None) or 0
    saved = [last_step // every * every] if every else []
    epochs = (trainer.epochs if trainer else None) or 1
    if total_steps and epochs:
        per_epoch = total_steps / epochs
        saved.append(int(last_step // per_epoch * per_epoch) if per_epoch else 0)
    if total_steps and last_step >= total_steps:
        saved.append(total_steps)
    return max(saved, default=0)


def start_plan(run: Run, new_spec: RunCreate, clean: bool, resume: bool = False) -> StartPlan:
    """What the new attempt starts from; a resume of another depth's checkpoint is refused unless `resume` asks
    for it (clean, or `fresh` in the command, trains from step 0 instead)."""
    if clean and resume:
        raise FieldError(("resume",), "resume keeps the checkpoint that clean would delete: ask for one of the two")
    plan = _plan(run, new_spec, clean)
    if plan.start == "resume" and plan.total_steps is not None and plan.from_step >= plan.total_steps:
        new_ttt = new_spec.ttt_steps
        raise FieldError(("resume",) if resume else ("clean",),
                         f"the checkpoint at step {plan.from_step} in {new_spec.clean_dir} is the last step of its "
                         f"training ({plan.from_step} of {plan.total_steps}): resuming it would train no step (the "
                         f"attempt trained them all, and ended or is in its final evaluation). Say clean: true to "
                         f"train TTT={new_ttt} from step 0 (longrun restart {run.name} --start fresh), or more "
                         f"epochs (--set epochs=N) to train on from it")
    if plan.other_depth and not resume:
        new_ttt = new_spec.ttt_steps
        raise FieldError(("resume",), f"the checkpoint at step {plan.from_step} in {new_spec.clean_dir} "
                         f"was trained with {plan.trained_ttt} TTT steps and this attempt trains {new_ttt}: say "
                         f"resume: true to continue it at TTT={new_ttt} for its remaining steps only, or clean: "
                         f"true to train TTT={new_ttt} from step 0 (longrun restart {run.name} --start resume / --start fresh)")
    return plan


def _plan(run: Run, new_spec: RunCreate, clean: bool) -> StartPlan:
    trainer = new_spec.trainer
    if trainer is None:
        return StartPlan("unknown", None, None, "an entrypoint run resumes as its own script does (longrun passes "
                         "no checkpoint): use clean to empty its output_dir first")
    if clean:
        return StartPlan("fresh", None, None, f"clean empties {trainer.output_dir} first: training starts at step 0")
    step, ttt, total = 0, None, None
    for a in run.attempts:
        past = a.typed_spec
        if past.trainer is None or past.trainer.output_dir != trainer.output_dir:
            continue
        saved = checkpoint_step(past, a.last_step, a.total_steps)
        if saved and saved >= step:
            step, ttt = saved, past.trainer.ttt_steps
            total = _steps_at(a.total_steps, past.trainer, trainer)
    if not step:
        return StartPlan("fresh", None, None, f"no checkpoint in {trainer.output_dir} yet: training starts at step 0")
    why = f"resumes the checkpoint at step {step} in {trainer.output_dir}"
    new_ttt = trainer.ttt_steps
    other_depth = ttt is not None and new_ttt is not None and ttt != new_ttt
    if other_depth:
        why += (f", trained with {ttt} TTT steps, continuing with {new_ttt} (its remaining steps only); "
                f"clean starts a TTT={new_ttt} training from step 0")
    return StartPlan("resume", step, ttt, why, other_depth, total)


def _steps_at(total_steps: int | None, past: TrainerSpec, new: TrainerSpec) -> int | None:
    """The steps the new attempt's training makes in all, from the attempt that made `total_steps` (the same data,
    batch and ranks): its epochs scaled, capped by the new `max_steps`; None when unknown (that attempt never said
    its total, or its own max_steps cut it short, as a probe's does)."""
    if not total_steps:
        return None
    capped = past.max_steps is not None and total_steps >= past.max_steps
    by_epochs = None if capped else total_steps * (new.epochs or 1) // (past.epochs or 1)
    limits = [n for n in (by_epochs, new.max_steps) if n]
    return min(limits) if limits else None
