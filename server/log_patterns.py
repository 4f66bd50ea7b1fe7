"""What a run spec's `log_metrics` may say: the built-in log formats and per-run patterns.

The worker parses logs with these (worker/log_metrics.py); the API validates specs with them (server/spec.py).
"""

import bisect
import heapq
import itertools
import posixpath
import random
from dataclasses import dataclass
from typing import Any

import regex

from server import torchrun_launch

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


# (not the sequence length: speculators packs to its total_seq_len, so a longer one makes fewer, longer steps)
SETTING_NAMES = {"epochs": EPOCH_NAMES, "max_steps": STEP_NAMES}


def setting_from_arguments(args: list[str] | None, name: str) -> int | None:
    """A foreign trainer's `epochs` or `max_steps` as its arguments name it (speculators' `--epochs`, SpecForge's
    `training.num_epochs=`), else None."""
    found = _arguments(list(args or []))
    return next((found[n] for n in SETTING_NAMES.get(name, ()) if found.get(n)), None)


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


# ---- totals of the trainers people run, from their command line and what the host reads for it --------------------
# (worker/hostside/totals.py reads a config's keys and the data's size on the host; these turn them into steps)

SPECULATORS_FLAGS = {  # speculators 0.9.0 train/config/resolution.py: `--` + the schema field with dashes
    "--config": "config", "--epochs": "trainer.epochs", "--max-steps": "trainer.max_steps",
    "--data-path": "data.data_path", "--total-seq-len": "data.total_seq_len",
    "--train-data-ratio": "data.train_data_ratio", "--seed": "seed",
}
SPECULATORS_INT = {"trainer.epochs", "trainer.max_steps", "data.total_seq_len", "seed"}
SPECFORGE_OPTIONS = {"-c": "config", "--config": "config", "--role": None, "--node-rank": None}
# a speculators epoch is simulated on at most this many rows drawn from the training split, scaled to the split
PACKING_SAMPLE_ROWS = 20_000


@dataclass(frozen=True)
class FoundTotal:
    """A run's total steps found from its trainer's arguments and data, and how (said in the run's answer)."""

    steps: int
    estimate: bool
    basis: str

    @property
    def note(self) -> str:
        return f"total {self.steps} steps {'estimated' if self.estimate else 'found'}: {self.basis}"


def _program(entrypoint: str | None, args: list[str]) -> tuple[str, list[str]] | None:
    """Which trainer's command line `entrypoint args` is (speculators' or SpecForge's `train`, itself or through
    torchrun: server/torchrun_launch.py) and its arguments after `train`."""
    entrypoint, args = torchrun_launch.program(entrypoint, args)
    if not entrypoint or not args or args[0] != "train":
        return None
    path = posixpath.normpath(entrypoint)
    name = posixpath.basename(path)
    for trainer in ("speculators", "specforge"):
        if name == trainer or path.endswith((f"/{trainer}/__main__.py", f"/{trainer}/cli.py")):
            return trainer, [str(a) for a in args[1:]]
    return None


def _options(args: list[str], names: dict[str, str | None]) -> tuple[dict[str, str], list[str]] | None:
    """argparse's reading of `--name value` / `--name=value` (and `-cVALUE` for a short one) for the options in
    `names`, and what else is positional; None where an argument abbreviates one of them (argparse would take it for
    that option: its total is not guessed)."""
    found: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, sep, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2 and flag in names:
            sep = "="  # -cPATH
        if flag in names:
            if not sep:
                if i + 1 >= len(args):
                    return None
                value, i = args[i + 1], i + 1
            if names[flag]:
                found[names[flag]] = value
        elif arg.startswith("--") and any(n.startswith(flag) and len(flag) > 2 for n in names if n.startswith("--")):
            return None
        elif not arg.startswith("-"):
            positional.append(arg)
        i += 1
    return found, positional


def _number(text: str, whole: bool) -> int | float | None:
    try:
        return int(text) if whole else float(text)
    except ValueError:
        return None


def totals_query(spec_entrypoint: str | None, args: list[str], cwd: str | None) -> dict[str, Any] | None:
    """What the host reads for the total of `entrypoint args` (worker/protocol.py TotalsQuery's fields), or None
    where it is no trainer whose total is read this way or its arguments state no more than they do today."""
    script = torchrun_launch.script_query(spec_entrypoint, args, cwd)
    if script is not None:
        return script
    program = _program(spec_entrypoint, args)
    if program is None:
        return None
    trainer, rest = program
    if trainer == "speculators":
        read = _options(rest, dict(SPECULATORS_FLAGS))
        if read is None:
            return None
        found, _ = read
        flags: dict[str, Any] = {}
        for key, text in found.items():
            if key == "config":
                continue
            if key == "data.data_path":
                flags[key] = text
            elif (value := _number(text, key in SPECULATORS_INT)) is None:
                return None  # argparse refuses it: the job will not run
            else:
                flags[key] = value
        return {"trainer": trainer, "cwd": cwd, "config": found.get("config"), "flags": flags, "overrides": []}
    read = _options(rest, dict(SPECFORGE_OPTIONS))
    if read is None or "config" not in read[0]:
        return None
    return {"trainer": trainer, "cwd": cwd, "config": read[0]["config"], "flags": {},
            "overrides": [a for a in read[1] if "=" in a]}


def _lpt_fits(lengths: list[int], max_len: int, replicas: int) -> bool:
    """Whether `lengths` fit `replicas` bins of `max_len` tokens, longest first into the emptiest bin
    (speculators 0.9.0 train/distributed_batch_sampler.py _lpt_packed_batch)."""
    bins = [0] * replicas
    for size in sorted(lengths, reverse=True):
        if bins[0] + size > max_len:
            return False
        heapq.heapreplace(bins, bins[0] + size)
    return True


def packed_batches(lengths: list[int], max_len: int, replicas: int) -> int:
    """How many batches speculators' MultipackDistributedBatchSamplerV2 packs `lengths` (in this order) into:
    _assign_to_packed_batches, the longest run of the next samples that LPT fits in `replicas` bins of `max_len`,
    found by its binary search, until fewer samples than replicas are left."""
    cumsum = list(itertools.accumulate(lengths))
    ind, so_far, batches = 0, 0, 0
    while len(lengths) - ind >= replicas:
        left = 1
        right = 1 + bisect.bisect_right(cumsum, so_far + max_len * replicas, lo=ind) - ind
        while right - left > 1 and right > replicas:
            mid = (left + right) // 2
            if _lpt_fits(lengths[ind: ind + mid], max_len, replicas):
                left = mid
            else:
                right = mid
        ind += left
        so_far = cumsum[ind - 1]
        batches += 1
    return batches


def _whole(value: Any, low: int = 1) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        value = int(value)
    return value if isinstance(value, int) and low <= value < 2**31 else None


def _speculators_total(facts: dict[str, Any], ranks: int) -> FoundTotal | None:
    settings = facts.get("settings") or {}
    source = facts.get("source") or {}

    def said(key: str) -> str:
        return {"flag": "its flag", "config": "its --config", "default": "speculators' default"}.get(
            source.get(key), "")

    max_steps = _whole(settings.get("trainer.max_steps"))
    if max_steps is not None:
        return FoundTotal(max_steps, False, f"speculators' max_steps {max_steps} ({said('trainer.max_steps')})")
    epochs, max_len = _whole(settings.get("trainer.epochs")), _whole(settings.get("data.total_seq_len"))
    data = facts.get("data") or {}
    pairs = data.get("lengths")
    rows, train_rows = _whole(data.get("rows"), 0), _whole(data.get("train_rows"), 0)
    if epochs is None or max_len is None or not isinstance(pairs, list) or rows is None or not train_rows:
        return None
    lengths: list[int] = []
    weights: list[int] = []
    for pair in pairs[: max_len + 1]:
        if not (isinstance(pair, list) and len(pair) == 2):
            return None
        length, count = _whole(pair[0], 0), _whole(pair[1])
        if length is None or count is None:
            return None
        lengths.append(min(length, max_len))
        weights.append(count)
    if sum(weights) != train_rows:
        return None
    rng = random.Random(_whole(settings.get("seed"), 0) or 0)
    if train_rows <= PACKING_SAMPLE_ROWS:
        sample = [length for length, count in zip(lengths, weights, strict=True) for _ in range(count)]
        rng.shuffle(sample)
    else:
        sample = rng.choices(lengths, weights=weights, k=PACKING_SAMPLE_ROWS)
    per_epoch = packed_batches(sample, max_len, ranks) * train_rows / len(sample)
    steps = max(1, round(per_epoch * epochs))
    tokens = sum(length * count for length, count in zip(lengths, weights, strict=True))
    return FoundTotal(steps, True, (
        f"{epochs} epochs ({said('trainer.epochs')}) x about {per_epoch:.0f} batches an epoch: the {train_rows} "
        f"training rows of {rows} in {data_path(settings)} ({tokens} tokens, train_data_ratio "
        f"{settings.get('data.train_data_ratio')}) packed to {max_len} tokens (total_seq_len) on each of {ranks} "
        f"ranks as speculators' multipack sampler packs them, on a shuffle of its own (speculators' shuffle "
        f"changes each epoch's count a little)"))


def data_path(settings: dict[str, Any]) -> str:
    return str(settings.get("data.data_path"))[:200]


def _specforge_total(facts: dict[str, Any], ranks: int) -> FoundTotal | None:
    s = facts.get("settings") or {}
    names = {k: _whole(s.get(f"training.{k}")) for k in ("num_epochs", "max_steps", "total_steps", "batch_size",
                                                         "accumulation_steps", "tp_size", "sp_ulysses_size",
                                                         "sp_ring_size")}
    nodes, per_node = _whole(s.get("deployment.trainer.nnodes")), _whole(s.get("deployment.trainer.nproc_per_node"))
    world = nodes * per_node if nodes and per_node else ranks
    files = _whole(facts.get("feature_files"), 0)
    natural, how = None, ""
    epochs, batch, accumulation = names["num_epochs"], names["batch_size"], names["accumulation_steps"]
    if files is not None and epochs and batch and accumulation:
        # the draft data-parallel ranks (SpecForge 0.2.0 launch.py _shard_offline_refs: a USP group shares its
        # samples; offline training keeps tp_size 1), each with ceil(N / dp) refs (DistributedSampler's padding)
        usp = s.get("training.attention_backend") == "usp"
        sp = (names["sp_ulysses_size"] or 1) * (names["sp_ring_size"] or 1) if usp else (names["tp_size"] or 1)
        dp = max(1, world // sp)
        per_rank = -(-files // dp)
        natural = (per_rank // batch) * epochs // accumulation
        how = (f"{files} feature files in {str(s.get('data.hidden_states_path'))[:200]} over {dp} data-parallel "
               f"ranks: (ceil({files} / {dp}) // batch_size {batch}) x num_epochs {epochs} // accumulation_steps "
               f"{accumulation} (SpecForge's resolve_total_steps)")
    if names["max_steps"] is not None:
        if natural is not None and natural < names["max_steps"]:
            return FoundTotal(natural, False, f"{how}, before max_steps {names['max_steps']}")
        end = f", before the data's end ({how} = {natural})" if natural is not None else ""
        return FoundTotal(names["max_steps"], False, f"SpecForge's training.max_steps {names['max_steps']}{end}")
    if natural:
        return FoundTotal(natural, False, how)
    if names["total_steps"] is not None:
        return FoundTotal(names["total_steps"], False, f"SpecForge's training.total_steps {names['total_steps']}")
    return None


def launch_ranks(entrypoint: str | None, args: list[str], ranks: int) -> int:
    """The ranks a run's trainer runs on: those torchrun starts where the run's command is a torchrun launch that
    says, else the run's own."""
    launch = torchrun_launch.torchrun(entrypoint, [str(a) for a in args])
    return launch[3] if launch is not None and launch[3] else ranks


def total_from_facts(trainer: str, facts: Any, ranks: int = 1) -> FoundTotal | None:
    """The total steps of a speculators or SpecForge run from what the host read for it (untrusted: anything not of
    the shape worker/hostside/totals.py answers with gives None)."""
    if not isinstance(facts, dict) or "unreadable" in facts:
        return None
    try:
        if trainer == "speculators":
            return _speculators_total(facts, max(1, ranks))
        if trainer == "specforge":
            return _specforge_total(facts, max(1, ranks))
        if trainer == "specforge_script":
            found = torchrun_launch.script_total(facts, max(1, ranks), _whole)
            return FoundTotal(*found) if found else None
    except (TypeError, ValueError, OverflowError, MemoryError):
        return None
    return None
