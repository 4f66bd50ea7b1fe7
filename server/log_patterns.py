"""What a run spec's `log_metrics` may say: the built-in log formats and per-run patterns.

The worker parses logs with these (worker/log_metrics.py); the API validates specs with them (server/spec.py).
"""

import regex

FORMATS = ("tqdm", "key_value", "json")
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 1000


def compile_pattern(text: str) -> regex.Pattern[str]:
    """A per-run pattern: a regular expression (Python syntax) with at least one named group; ValueError says
    what is wrong. Compiled with `regex`, whose searches take a time limit."""
    if len(text) > MAX_PATTERN_CHARS:
        raise ValueError(f"a pattern may be at most {MAX_PATTERN_CHARS} characters")
    try:
        pattern = regex.compile(text)
    except (regex.error, RecursionError, OverflowError, ValueError) as exc:
        raise ValueError(f"not a regular expression: {exc}") from None
    if not pattern.groupindex:
        raise ValueError("a pattern needs a named group, such as (?P<loss>[0-9.]+); each names a series")
    for name in pattern.groupindex:
        if len(name) > 128:
            raise ValueError(f"group name {name[:20]!r}... is longer than 128 characters")
    return pattern


# A foreign trainer's total steps from its command line (speculators' `--epochs` / `--max-steps`, SpecForge's
# `training.num_epochs` / `training.max_steps` / `training.total_steps` / `training.batch_size` /
# `training.accumulation_steps`, as flags or `key=value` overrides): steps named outright, else
# epochs x samples / (batch x accumulation x ranks) where the arguments name the samples too.
STEP_NAMES = ("max_steps", "total_steps", "max_num_steps", "num_train_steps")
EPOCH_NAMES = ("epochs", "num_epochs", "num_train_epochs")
BATCH_NAMES = ("batch_size", "train_batch_size", "per_device_train_batch_size")
ACCUMULATION_NAMES = ("accumulation_steps", "gradient_accumulation_steps", "draft_accumulation_steps")
SAMPLE_NAMES = ("num_samples", "max_samples", "train_samples")
NO_TOTAL_NOTE = ("no total steps known: neither the log nor the trainer's arguments give one (its max steps, or "
                 "epochs with the samples and the batch size); set `log_metrics.total_steps` in the run spec, or "
                 "print `step N/TOTAL`")


def _arguments(args: list[str]) -> dict[str, int]:
    """Whole-number settings named in `args`: `--name N`, `--name=N`, `name=N`, with dots (a section) dropped and
    dashes read as underscores."""
    found: dict[str, int] = {}
    for i, arg in enumerate(args[:4096]):
        if not isinstance(arg, str) or len(arg) > 200:
            continue
        key, sep, value = arg.partition("=")
        if not sep:
            if not arg.startswith("--") or i + 1 >= len(args) or not isinstance(args[i + 1], str):
                continue
            value = args[i + 1]
        name = key.lstrip("-").rsplit(".", 1)[-1].replace("-", "_").lower()
        if value.strip().isdigit() and len(value.strip()) < 10:
            found[name] = int(value)
    return found


def total_from_arguments(args: list[str] | None, ranks: int = 1) -> int | None:
    """The run's total steps where a foreign trainer's arguments give them, else None."""
    found = _arguments(list(args or []))

    def first(names: tuple[str, ...]) -> int | None:
        return next((found[n] for n in names if found.get(n)), None)

    if (steps := first(STEP_NAMES)) is not None:
        return steps
    epochs, samples = first(EPOCH_NAMES), first(SAMPLE_NAMES)
    if epochs is None or samples is None:
        return None
    per_step = (first(BATCH_NAMES) or 1) * (first(ACCUMULATION_NAMES) or 1) * max(ranks, 1)
    return max(1, -(-epochs * samples // per_step))
