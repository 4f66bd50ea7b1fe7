"""What a foreign trainer's total steps are made of, read on the host where its config and data are: the few keys of
its YAML (or JSON) config that decide the total, and the size of its training data (speculators: the rows and
token lengths of its Arrow dataset; SpecForge: the number of offline feature files). The worker turns these facts
into a total (server/log_patterns.py total_from_facts).

Standard library only, Python 3.8 and later, like the rest of worker/hostside/: no YAML or Arrow library. The YAML is
read by a line reader that takes block mappings of plain or quoted scalars and says which keys it could not read
(flow collections, anchors, aliases, tags, block scalars); the Arrow dataset by its IPC messages, seeking to the one
column's buffers only (worker/hostside/arrow.py). Anything it cannot read is
an `unreadable` reason in the answer, never a guess and never an exception.

The request (`totals`, worker/protocol.py TotalsQuery):
  {"trainer": "speculators" | "specforge" | "specforge_script", "cwd": DIR, "config": PATH | null,
   "flags": {name: value}, "overrides": ["section.key=value", ...]}
"""

import json
import os
import re
import struct
from array import array

from .arrow import Unreadable, arrow_column

# a config of more is not a training recipe
MAX_CONFIG_BYTES = 1 << 20
# more rows than this are not counted (the total stays unknown; a run that large states it)
MAX_ROWS = 50_000_000
# SpecForge's offline feature files counted at most (os.walk of the hidden-states directory)
MAX_FEATURE_FILES = 10_000_000
FEATURE_SUFFIXES = (".ckpt", ".ckpt.gz")  # specforge/runtime/data_plane/offline_reader.py _FEATURE_SUFFIXES
# the keys each trainer's total depends on, by their dotted path in its config, with the defaults of its schema
SPECULATORS_KEYS = {  # speculators 0.9.0 train/config/schema.py (DataArgs, TrainerArgs, TrainConfig)
    "data.data_path": "./output", "data.total_seq_len": 8192, "data.train_data_ratio": 0.9,
    "trainer.epochs": 20, "trainer.max_steps": None, "seed": 42,
}
SPECFORGE_KEYS = {  # SpecForge 0.2.0 specforge/config/schema.py (DataConfig, TrainingConfig, TrainerDeploymentConfig)
    "data.hidden_states_path": "", "data.train_data_path": "", "data.prompts_path": "",
    "training.num_epochs": 1, "training.max_steps": None, "training.total_steps": None,
    "training.batch_size": 1, "training.accumulation_steps": 1, "training.tp_size": 1,
    "training.sp_ulysses_size": 1, "training.sp_ring_size": 1, "training.attention_backend": "flex_attention",
    "deployment.trainer.nnodes": 1, "deployment.trainer.nproc_per_node": 1,
}


# YAML 1.1's whole numbers and floats as PyYAML's safe_load resolves them (a leading 0 is octal, 0x hex: not taken)
INT_RE = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$")
OCTAL_RE = re.compile(r"^[-+]?0(?:[0-7_]+|x[0-9a-fA-F_]+|b[01_]+)$")
FLOAT_RE = re.compile(r"^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+][0-9]+)?$")


# ---- YAML: block mappings of scalars ------------------------------------------------------------------------------

def _strip_comment(text):
    """`text` without a trailing ` # comment` outside quotes."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def _scalar(text):
    """A YAML 1.1 plain or quoted scalar as safe_load reads the ones a config of these keys holds; Unreadable for
    anything else (a flow collection, an alias, an anchor, a tag, a block scalar)."""
    if not text:
        return None
    first = text[0]
    if first == '"':
        if len(text) < 2 or not text.endswith('"'):
            raise Unreadable("a double-quoted value that does not end on its line")
        try:
            return json.loads(text)
        except ValueError:
            raise Unreadable("a double-quoted value with escapes this reader does not take") from None
    if first == "'":
        if len(text) < 2 or not text.endswith("'"):
            raise Unreadable("a single-quoted value that does not end on its line")
        return text[1:-1].replace("''", "'")
    if first in "[{&*!|>%@`":
        raise Unreadable(f"a value in a form this reader does not take ({first!r})")
    lower = text.lower()
    if lower in ("null", "~"):
        return None
    if lower in ("true", "yes", "on"):
        return True
    if lower in ("false", "no", "off"):
        return False
    if INT_RE.match(text):
        return int(text.replace("_", ""))
    if OCTAL_RE.match(text):
        raise Unreadable(f"a number in a form this reader does not take ({text!r})")
    if FLOAT_RE.match(text):
        return float(text.replace("_", ""))
    return text


def read_yaml(text):
    """The scalars of a YAML document of block mappings, by dotted path, and the paths it could not read with why
    ({path: reason}; a sequence, a multi-line value or a form it does not take). Later keys win, as in safe_load."""
    values, unreadable = {}, {}
    stack = []  # (indent, key) of the mappings the line is in
    skip_below = None  # the indent a sequence or a block scalar's lines are deeper than
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#") or stripped in ("---", "..."):
            continue
        if "\t" in line[: len(line) - len(stripped)]:
            raise Unreadable(f"line {number}: indented with a tab")
        indent = len(line) - len(stripped)
        if skip_below is not None:
            if indent > skip_below or (indent == skip_below and stripped.startswith("- ")) or stripped == "-":
                continue
            skip_below = None
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join(key for _, key in stack)
        if stripped.startswith("- ") or stripped == "-":
            unreadable[path] = "a sequence"
            skip_below = indent
            continue
        key, sep, rest = _key_value(stripped)
        if not sep:
            raise Unreadable(f"line {number}: neither `key: value` nor a list item")
        full = path + "." + key if path else key
        rest = _strip_comment(rest.strip())
        if not rest:
            stack.append((indent, key))
            values.pop(full, None)
            continue
        if rest[0] in "|>":
            unreadable[full] = "a multi-line value"
            skip_below = indent
            continue
        try:
            values[full] = _scalar(rest)
            unreadable.pop(full, None)
        except Unreadable as exc:
            unreadable[full] = str(exc)
            if rest[0] in "[{" and not rest.endswith(("]", "}")):
                skip_below = indent  # a flow collection over several lines
    return values, unreadable


def _key_value(text):
    """`key`, `:`, the rest of `key: value` (a quoted key too)."""
    if text[0] in "'\"":
        end = text.find(text[0], 1)
        if end < 0 or text[end + 1: end + 2] != ":":
            return text, "", ""
        return text[1:end], ":", text[end + 2:]
    at = text.find(": ")
    if at < 0 and text.endswith(":"):
        at = len(text) - 1
    if at <= 0:
        return text, "", ""
    return text[:at].strip(), ":", text[at + 1:]


def _flatten_json(obj, prefix, out):
    for key, value in obj.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            _flatten_json(value, name + ".", out)
        elif not isinstance(value, list):
            out[name] = value


def read_config(path):
    """The config's scalars by dotted path and what it could not read: JSON where the name does not end in .yaml or
    .yml (as SpecForge's Config.from_file reads it), else YAML."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise Unreadable(f"cannot read the config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise Unreadable(f"the config {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable(f"the config {path} is not UTF-8") from None
    if path.endswith((".yaml", ".yml")):
        try:
            return read_yaml(text)
        except Unreadable as exc:
            raise Unreadable(f"the config {path}: {exc}") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise Unreadable(f"the config {path} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise Unreadable(f"the config {path} is not a mapping")
    values = {}
    _flatten_json(obj, "", values)
    return values, {}


def _pick(keys, values, unreadable, prefix=""):
    """The settings named in `keys` from the config's `values` (under `prefix`), with where each came from; a key
    the config holds in a form it could not read is Unreadable."""
    found = {}
    for key in keys:
        path = prefix + key
        blocked = next((p for p in unreadable if p == path or (p and path.startswith(p + "."))), None)
        if blocked is not None:
            raise Unreadable(f"`{blocked}` is {unreadable[blocked]} this reader does not take")
        if path in values:
            found[key] = values[path]
    return found


def dataset_files(directory):
    """The Arrow files of a `datasets` directory (save_to_disk) in the order load_from_disk reads them."""
    state = os.path.join(directory, "state.json")
    try:
        with open(state, "rb") as f:
            listed = json.loads(f.read(MAX_CONFIG_BYTES).decode("utf-8"))
        names = [entry["filename"] for entry in listed["_data_files"]]
    except OSError:
        if os.path.exists(os.path.join(directory, "dataset_dict.json")):
            raise Unreadable(f"{directory} holds a DatasetDict (splits); speculators reads one dataset") \
                from None
        raise Unreadable(f"{directory} has no state.json: not a dataset saved with save_to_disk") from None
    except (ValueError, KeyError, TypeError):
        raise Unreadable(f"{directory}'s state.json does not list its data files") from None
    if not names or not all(isinstance(n, str) and "/" not in n and n not in (".", "..") for n in names):
        raise Unreadable(f"{directory}'s state.json does not list its data files")
    return [os.path.join(directory, n) for n in names]


def speculators_data(directory, total_seq_len, train_data_ratio):
    """The training split of a speculators dataset: its rows (the first int(rows x ratio), train/data.py
    ArrowDataset) and their token lengths clipped to total_seq_len (distributed_batch_sampler.py truncates longer
    ones), as [length, count] pairs, with the rows in all and the longest length."""
    lengths = array("q")
    for path in dataset_files(directory):
        try:
            lengths.extend(arrow_column(path, "seq_len"))
        except OSError as exc:
            raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
        except struct.error:
            raise Unreadable(f"{path} is not an Arrow file this reader can follow") from None
        except Unreadable as exc:
            raise Unreadable(f"{path}: {exc}") from None
    rows = len(lengths)
    train_rows = int(rows * train_data_ratio)
    counts = {}
    for value in lengths[:train_rows]:
        value = min(max(0, value), total_seq_len)
        counts[value] = counts.get(value, 0) + 1
    return {"rows": rows, "train_rows": train_rows, "lengths": sorted([k, v] for k, v in counts.items()),
            "longest": max(lengths) if rows else 0}


def feature_files(path):
    """How many offline feature files SpecForge's OfflineManifestReader lists under `path` (list_feature_files)."""
    if os.path.isfile(path):
        return 1
    if not os.path.isdir(path):
        raise Unreadable(f"the hidden states path {path} is not a directory")
    count = 0
    for _root, _dirs, names in os.walk(path):
        count += sum(1 for name in names if name.endswith(FEATURE_SUFFIXES))
        if count > MAX_FEATURE_FILES:
            raise Unreadable(f"more than {MAX_FEATURE_FILES} feature files under {path}")
    return count


# ---- the answer ---------------------------------------------------------------------------------------------------

def _resolve(cwd, path):
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(cwd, path)


def _overrides(settings, overrides, keys):
    """SpecForge's `section.key=value` overrides (config/schema.py apply_overrides) onto `settings`, read as YAML
    scalars as pydantic would coerce them; an override of a key the total does not depend on is passed over."""
    for item in overrides:
        path, sep, value = str(item).partition("=")
        if sep and path in keys:
            try:
                settings[path] = _scalar(value.strip())
            except Unreadable:
                settings[path] = value


def speculators_facts(req, cwd):
    settings = dict(SPECULATORS_KEYS)
    source = {key: "default" for key in settings}
    if req.get("config"):
        values, unreadable = read_config(_resolve(cwd, req["config"]))
        # a stage-shaped file holds the trainer's keys under `train:`; a bare mapping is read as they are
        # (speculators train/config/resolution.py _unwrap_stage)
        staged = any(p == "train" or p.startswith("train.") for p in list(values) + list(unreadable))
        from_file = _pick(settings, values, unreadable, "train." if staged else "")
        settings.update(from_file)
        source.update({key: "config" for key in from_file})
    for key, value in (req.get("flags") or {}).items():
        if key in settings:
            settings[key], source[key] = value, "flag"
    if settings["trainer.max_steps"] is not None:
        return {"settings": settings, "source": source}  # the total is stated: no data to read
    ratio, seq = settings["data.train_data_ratio"], settings["data.total_seq_len"]
    if not isinstance(ratio, (int, float)) or not 0 < ratio < 1 or not isinstance(seq, int) or seq < 1:
        raise Unreadable(f"train_data_ratio {ratio!r} or total_seq_len {seq!r} is not what speculators takes")
    data = speculators_data(_resolve(cwd, str(settings["data.data_path"])), seq, ratio)
    return {"settings": settings, "source": source, "data": data}


def specforge_facts(req, cwd):
    if not req.get("config"):
        raise Unreadable("no --config")
    values, unreadable = read_config(_resolve(cwd, req["config"]))
    settings = dict(SPECFORGE_KEYS)
    source = {key: "default" for key in settings}
    from_file = _pick(settings, values, unreadable)
    settings.update(from_file)
    source.update({key: "config" for key in from_file})
    before = dict(settings)
    _overrides(settings, req.get("overrides") or [], SPECFORGE_KEYS)
    source.update({key: "override" for key in settings if settings[key] != before[key]})
    facts = {"settings": settings, "source": source}
    if settings["data.hidden_states_path"]:
        try:
            facts["feature_files"] = feature_files(_resolve(cwd, str(settings["data.hidden_states_path"])))
        except Unreadable as exc:
            if settings["training.total_steps"] is None and settings["training.max_steps"] is None:
                raise
            facts["feature_files_unreadable"] = str(exc)  # the stated steps are the total still
    return facts


def data_rows(path):
    """The non-empty lines of a JSON Lines file (the rows `load_dataset("json", ...)` reads), at most MAX_ROWS."""
    if not os.path.isfile(path):
        raise Unreadable(f"the training data {path} is not a file")
    rows = 0
    with open(path, "rb") as f:
        for line in f:
            rows += bool(line.strip())
            if rows > MAX_ROWS:
                raise Unreadable(f"more than {MAX_ROWS} rows in {path}")
    return rows


def specforge_script_facts(req, cwd):
    """SpecForge's scripts/train_eagle3.py (server/torchrun_launch.py): its flags as given, and the size of its data:
    the offline feature files under --train-hidden-states-path, else the rows of --train-data-path."""
    flags = {k: v for k, v in (req.get("flags") or {}).items() if isinstance(v, (int, str))}
    facts = {"settings": flags}
    if flags.get("hidden_states_path"):
        facts["feature_files"] = feature_files(_resolve(cwd, str(flags["hidden_states_path"])))
    elif flags.get("train_data_path"):
        facts["rows"] = data_rows(_resolve(cwd, str(flags["train_data_path"])))
    else:
        raise Unreadable("no --train-hidden-states-path or --train-data-path")
    return facts


def totals(req, default_cwd="."):
    """The facts of the request's trainer, or {"unreadable": why}; relative paths are the job's, from its `cwd` (a
    launch's: the attempt directory where the run names none)."""
    if not isinstance(req, dict):
        return {"unreadable": "the request is not an object"}
    trainer = req.get("trainer")
    cwd = req.get("cwd") or default_cwd
    try:
        if trainer == "speculators":
            return speculators_facts(req, cwd)
        if trainer == "specforge":
            return specforge_facts(req, cwd)
        if trainer == "specforge_script":
            return specforge_script_facts(req, cwd)
        return {"unreadable": f"no trainer {trainer!r}"}
    except Unreadable as exc:
        return {"unreadable": str(exc)}
    except (OSError, ValueError, struct.error, MemoryError, RecursionError, IndexError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
