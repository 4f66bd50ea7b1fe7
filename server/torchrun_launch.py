"""Foreign trainers launched through torchrun, and SpecForge's script launch: which trainer's command line a run's
`entrypoint args` are once torchrun's own options are read off, how many ranks torchrun starts, and the total
steps of SpecForge's scripts/train_eagle3.py from its flags and data (server/log_patterns.py reads the rest).

- torchrun (torch/distributed/run.py get_args_parser, torch 2.x): its options, then the training script (or with
  `-m`/`--module` a module) and the script's own arguments. `torchrun -m speculators.train ARGS` is speculators'
  documented multi-GPU launch (speculators 0.9.0 src/speculators/train/__main__.py: TrainConfig.resolve() on ARGS,
  the parser of `speculators train`); `torchrun ... scripts/train_eagle3.py ARGS` SpecForge's script launch.
- scripts/train_eagle3.py (sgl-project/SpecForge @ 054c8cf, before the `specforge train` CLI of 0.2.0): argparse
  flags; sanity_check: dp = world // tp_size, target_batch_size = tp_size x batch_size, draft_accumulation_steps
  x= sp_ulysses_size x sp_ring_size; prepare_dp_dataloaders shards the dataset over the dp group (the draft dp
  group with --attention-backend usp) and batches target_batch_size; total_steps = num_epochs x ceil(len(loader) /
  draft_accumulation_steps). A run that states --total-steps or --max-num-steps has that total from its command line
  (server/log_patterns.py total_from_arguments), before any of this.
"""

import math
import posixpath
from typing import Any

# torchrun's options that take no value; every other option takes one (`--name value` or `--name=value`)
TORCHRUN_FLAGS = {"-m", "--module", "--standalone", "--no-python", "--no_python", "--run-path", "--run_path",
                  "--virtual-local-rank", "--virtual_local_rank"}
SCRIPT = "train_eagle3.py"
SCRIPT_FLAGS = {  # scripts/train_eagle3.py parse_args: flag -> (key, whole number)
    "--num-epochs": "num_epochs", "--batch-size": "batch_size",
    "--draft-accumulation-steps": "accumulation_steps", "--tp-size": "tp_size",
    "--sp-ulysses-size": "sp_ulysses_size", "--sp-ring-size": "sp_ring_size",
    "--attention-backend": "attention_backend", "--train-hidden-states-path": "hidden_states_path",
    "--train-data-path": "train_data_path",
}
SCRIPT_DEFAULTS = {"num_epochs": 10, "batch_size": 1, "accumulation_steps": 1, "tp_size": 1, "sp_ulysses_size": 1,
                   "sp_ring_size": 1, "attention_backend": "flex_attention"}


def torchrun(entrypoint: str | None, args: list[str]) -> tuple[str, bool, list[str], int | None] | None:
    """(the training script or module, whether it is a module, its arguments, the ranks torchrun starts where its
    options say) for a torchrun launch (`torchrun ...` or `python -m torch.distributed.run ...`); else None."""
    name = posixpath.basename(posixpath.normpath(entrypoint or ""))
    if name.startswith("python") and args[:2] == ["-m", "torch.distributed.run"]:
        args = args[2:]
    elif name != "torchrun":
        return None
    module, per_node, nodes, i = False, "1", "1", 0
    while i < len(args) and args[i].startswith("-"):
        flag, eq, value = args[i].partition("=")
        if flag in ("-m", "--module"):
            module = True
        elif flag not in TORCHRUN_FLAGS and not eq:
            value, i = (args[i + 1] if i + 1 < len(args) else ""), i + 1
        if flag in ("--nproc-per-node", "--nproc_per_node"):
            per_node = value
        elif flag == "--nnodes":
            low, _, high = value.partition(":")
            nodes = low if not high or low == high else ""  # an elastic range: not known before it starts
        i += 1
    if i >= len(args):
        return None
    world = int(per_node) * int(nodes) if per_node.isdigit() and nodes.isdigit() else None
    return args[i], module, [str(a) for a in args[i + 1:]], world


def program(entrypoint: str | None, args: list[str]) -> tuple[str | None, list[str]]:
    """The entrypoint and arguments torchrun runs (`-m speculators.train` as `speculators train`), or the run's own."""
    launch = torchrun(entrypoint, args)
    if launch is None:
        return entrypoint, list(args)
    target, module, rest, _ = launch
    if module and target == "speculators.train":
        return "speculators", ["train", *rest]
    if module:
        return None, rest
    return target, rest


def script_query(entrypoint: str | None, args: list[str], cwd: str | None) -> dict[str, Any] | None:
    """The totals query of a scripts/train_eagle3.py launch (its own or through torchrun), else None."""
    launch = torchrun(entrypoint, args)
    if launch is not None and not launch[1]:
        entrypoint, args = launch[0], launch[2]
    elif posixpath.basename(entrypoint or "").startswith("python") and args and not args[0].startswith("-"):
        entrypoint, args = args[0], args[1:]
    if posixpath.basename(entrypoint or "") != SCRIPT:
        return None
    flags: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag, eq, value = str(args[i]).partition("=")
        if flag in SCRIPT_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    return None  # argparse refuses it: the job will not run
                value, i = str(args[i + 1]), i + 1
            key = SCRIPT_FLAGS[flag]
            if key in ("attention_backend", "hidden_states_path", "train_data_path"):
                flags[key] = value
            elif not value.lstrip("+").isdigit():
                return None
            else:
                flags[key] = int(value)
        i += 1
    return {"trainer": "specforge_script", "cwd": cwd, "config": None, "flags": flags, "overrides": []}


def script_total(facts: dict[str, Any], ranks: int, whole) -> tuple[int, bool, str] | None:
    """(total steps, estimate, how) of a scripts/train_eagle3.py run from what its host read."""
    s = {**SCRIPT_DEFAULTS, **(facts.get("settings") or {})}
    names = ("num_epochs", "batch_size", "accumulation_steps", "tp_size", "sp_ulysses_size", "sp_ring_size")
    epochs, batch, accumulation, tp, ulysses, ring = (whole(s.get(k)) for k in names)
    files, rows = whole(facts.get("feature_files"), 0), whole(facts.get("rows"), 0)
    samples = files if files is not None else rows
    if not (samples and epochs and batch and accumulation and tp and ulysses and ring):
        return None
    group = ranks // (ulysses * ring) if s.get("attention_backend") == "usp" else ranks // tp
    group = max(1, group)
    loader = math.ceil(math.ceil(samples / group) / (tp * batch))
    per_epoch = math.ceil(loader / (accumulation * ulysses * ring))
    total = epochs * per_epoch
    what = f"{files} feature files" if files is not None else f"{rows} rows of --train-data-path (before filtering)"
    how = (f"{what} over {group} data-parallel ranks in batches of {tp * batch}: num_epochs {epochs} x "
           f"ceil({loader} / {accumulation * ulysses * ring}) (scripts/train_eagle3.py total_steps)")
    return total, files is None, how
