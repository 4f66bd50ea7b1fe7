"""A run of speculators' or SpecForge's own `train` gets a total without a hand-set one: its command line read as the
real CLI's parser reads it, its config and data read on the host (worker/hostside/totals.py, standard library only),
the total computed as the trainer computes it (server/log_patterns.py). Each case is checked against the real
speculators 0.9.0 and SpecForge 0.2.0 code (installed --no-deps by the Makefile)."""

import json
import logging
import math
import random
import warnings
from pathlib import Path

import pytest

from server.spec import RunCreate
from worker.hostside import totals as hostside
from worker.log_metrics import LogMetricsConfig, found_total, read_log, totals_query

SPECULATORS = "/venv/bin/speculators"
SPECFORGE = "/venv/bin/specforge"


def spec(entrypoint: str, args: list[str], cwd: Path, nproc: int = 1) -> RunCreate:
    return RunCreate.model_validate({"name": "t", "host": "local", "entrypoint": entrypoint, "args": args,
                                     "cwd": str(cwd), "nproc_per_node": nproc})


def host_total(run: RunCreate):
    """What the worker makes of the host's answer to the launch's totals query."""
    query = totals_query(run)
    assert query is not None
    facts = hostside.totals(json.loads(json.dumps(query.__dict__)))  # as it crosses the wire
    return found_total(run, json.loads(json.dumps(facts))), facts


# ---- speculators 0.9.0: epochs x the packed batches of its Arrow dataset ------------------------------------------

def write_dataset(out: Path, lengths: list[int], shards: int) -> None:
    """A speculators dataset written by speculators' own preprocessing and datasets' save_to_disk (as
    cli/prepare_data.py does), in several Arrow files of several record batches each."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    raw = Dataset.from_dict({"input_ids": [[7] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]})
    built = build_speculator_training_dataset(raw, None, max_length=100_000, num_proc=1)
    built.save_to_disk(str(out), num_shards=shards)


def real_speculators_steps(argv: list[str], cwd: Path, world: int) -> tuple[int, object]:
    """speculators' own count: its config resolved from `argv` by its CLI, its training split (ArrowDataset), its
    sampler's batches each epoch (the scheduler's num_epochs x len(train_loader), on rank 0 of `world`)."""
    import os

    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    here = os.getcwd()
    os.chdir(cwd)
    try:
        cfg = TrainConfig.resolve(["--verifier-name-or-path", "/v", *argv])
        dataset = ArrowDataset(max_len=cfg.data.total_seq_len, datapath=cfg.data.data_path,
                               train_ratio=cfg.data.train_data_ratio, split="train")
    finally:
        os.chdir(here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = MultipackDistributedBatchSamplerV2(cfg.data.total_seq_len, dataset.approx_lengths, world, 0,
                                                     seed=cfg.seed)
    steps = 0
    for epoch in range(cfg.trainer.epochs):
        sampler.set_epoch(epoch)
        steps += len(sampler)
    return steps, cfg


@pytest.mark.parametrize(("argv", "config", "world"), [
    (["--epochs", "3", "--data-path", "data"], None, 1),
    (["--epochs=2", "--data-path=data", "--total-seq-len", "2048", "--train-data-ratio", "0.8"], None, 4),
    # the YAML holds the epochs and the data; a flag overrides the YAML's total_seq_len
    (["--config", "run.yaml", "--total-seq-len", "3000"],
     "train:\n  data:\n    data_path: data  # the prepared dataset\n    total_seq_len: 1024\n"
     "  trainer:\n    epochs: 4\n  seed: 7\n", 2),
    # speculators' default data path (./output) and 20 epochs
    ([], None, 8),
])
def test_speculators_epochs_give_an_estimate_within_two_percent_of_its_own_count(
        tmp_path: Path, argv: list[str], config: str | None, world: int) -> None:
    rng = random.Random(len(argv) + world)
    lengths = [rng.randrange(20, 2500) for _ in range(3000)]
    write_dataset(tmp_path / ("output" if not argv else "data"), lengths, shards=3)
    if config:
        (tmp_path / "run.yaml").write_text(config)
    real, cfg = real_speculators_steps(argv, tmp_path, world)

    found, facts = host_total(spec(SPECULATORS, ["train", "--verifier-name-or-path", "/v", *argv], tmp_path, world))
    assert found is not None, facts
    assert found.estimate and abs(found.steps - real) / real < 0.02, (found.steps, real)
    settings = facts["settings"]
    assert settings["trainer.epochs"] == cfg.trainer.epochs and settings["data.total_seq_len"] == cfg.data.total_seq_len
    assert settings["data.train_data_ratio"] == cfg.data.train_data_ratio and settings["seed"] == cfg.seed
    assert facts["data"]["rows"] == 3000 and facts["data"]["train_rows"] == int(3000 * cfg.data.train_data_ratio)
    # the answer says it is an estimate and what it came from
    assert found.note.startswith(f"total {found.steps} steps estimated: {cfg.trainer.epochs} epochs")
    assert f"{facts['data']['train_rows']} training rows of 3000" in found.note and f"{world} ranks" in found.note


def test_speculators_max_steps_in_its_yaml_is_the_total_and_no_data_is_read(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("trainer:\n  max_steps: 250\n  epochs: 3\n")
    _, cfg = real_speculators_steps_config(["--config", "run.yaml"], tmp_path)
    found, facts = host_total(spec(SPECULATORS, ["train", "--config", "run.yaml"], tmp_path))
    assert cfg.trainer.max_steps == 250 and found is not None and found.steps == 250 and not found.estimate
    assert "data" not in facts  # ./output does not exist: nothing was read


def real_speculators_steps_config(argv: list[str], cwd: Path):
    import os

    from speculators.train.config import TrainConfig

    here = os.getcwd()
    os.chdir(cwd)
    try:
        return None, TrainConfig.resolve(["--verifier-name-or-path", "/v", *argv])
    finally:
        os.chdir(here)


def test_speculators_arguments_its_parser_reads_otherwise_give_no_total(tmp_path: Path) -> None:
    from speculators.train.config.resolution import build_parser

    # argparse takes `--epoch` for `--epochs`: a total from the default 20 epochs would be wrong, so none is given
    assert build_parser().parse_args(["--epoch", "4"]).epochs == 4
    assert totals_query(spec(SPECULATORS, ["train", "--epoch", "4"], tmp_path)) is None
    # a stated max steps is today's total (no host read); another program is not read as speculators
    assert totals_query(spec(SPECULATORS, ["train", "--max-steps", "9"], tmp_path)) is None
    assert totals_query(spec("/opt/train.py", ["train", "--epochs", "3"], tmp_path)) is None
    # a dataset the host cannot read says why, and the run stays without a total
    found, facts = host_total(spec(SPECULATORS, ["train", "--data-path", "missing"], tmp_path))
    assert found is None and "has no state.json" in facts["unreadable"]


# ---- SpecForge 0.2.0: `specforge train -c run.yaml [overrides]` --------------------------------------------------

SPECFORGE_YAML = """\
model:
  target_model_path: "meta-llama/Llama-3.1-8B-Instruct"
  draft_model_config: "configs/llama3-8B-eagle3.json"
data:
  hidden_states_path: "./cache/hidden_states"
  max_length: 4096
training:
  strategy: "eagle3"
  num_epochs: {epochs}
  batch_size: {batch}
  accumulation_steps: {accumulation}
  learning_rate: 0.0001   # 1e-4
  attention_backend: "{backend}"
  sp_ulysses_size: {sp}
{extra}deployment:
  trainer:
    nproc_per_node: {world}
run_id: "t"
output_dir: "./outputs/t"
"""


def real_specforge_steps(argv: list[str], cwd: Path) -> int:
    """SpecForge's own total: its CLI's parser and load_config (YAML and overrides), the offline refs its
    OfflineManifestReader lists, rank 0's share of them (launch.py _shard_offline_refs) and resolve_total_steps,
    with the loop's stop at max_steps."""
    import os

    import specforge.cli as cli
    from specforge.launch import _shard_offline_refs
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.training.schedule import resolve_total_steps

    loaded = []

    class Parsed(Exception):
        pass

    def load(path: str, overrides: list[str]):
        loaded.append(cli.load_config.__wrapped__(path, overrides))
        raise Parsed

    here = os.getcwd()
    os.chdir(cwd)
    real_load = cli.load_config
    load.__wrapped__ = real_load  # type: ignore[attr-defined]
    cli.load_config = load
    try:
        with pytest.raises(Parsed):
            cli.main(argv)
        cfg = loaded[0]
        t = cfg.training
        world = cfg.deployment.trainer.nnodes * cfg.deployment.trainer.nproc_per_node
        cfg.validate_world_size(world)
        usp = t.attention_backend == "usp"
        dp = world // (t.sp_ulysses_size * t.sp_ring_size) if usp else world // t.tp_size
        refs = OfflineManifestReader(cfg.data.hidden_states_path).read()
        share = _shard_offline_refs(refs, use_usp_preprocess=usp, dp_rank=0, dp_size=dp)
    finally:
        cli.load_config = real_load
        os.chdir(here)
    total = resolve_total_steps(total_steps=t.total_steps, max_steps=t.max_steps, num_samples=len(share),
                                batch_size=t.batch_size, accumulation_steps=t.accumulation_steps,
                                num_epochs=t.num_epochs)
    natural = resolve_total_steps(total_steps=None, max_steps=None, num_samples=len(share),
                                  batch_size=t.batch_size, accumulation_steps=t.accumulation_steps,
                                  num_epochs=t.num_epochs)
    return min(total, natural) if t.max_steps else natural


BASE = {"epochs": 3, "batch": 2, "accumulation": 1, "backend": "sdpa", "sp": 1, "world": 1, "extra": ""}


@pytest.mark.parametrize(("files", "fmt", "overrides"), [
    (100, BASE, []),
    # 8 ranks: each takes ceil(101 / 8) refs (DistributedSampler's padding); accumulation 2
    (101, {**BASE, "epochs": 2, "batch": 3, "accumulation": 2, "backend": "flex_attention", "world": 8}, []),
    # USP: 4 ranks in groups of 2 share their samples
    (37, {**BASE, "epochs": 1, "batch": 1, "backend": "usp", "sp": 2, "world": 4}, []),
    # command-line overrides win over the YAML; the YAML's max_steps before the data's end stops there
    (100, {**BASE, "extra": "  max_steps: 90\n"}, ["training.num_epochs=5", "training.batch_size=4"]),
    # a max_steps past the data's end: the data's end; a total_steps sets only the schedule's horizon
    (100, {**BASE, "extra": "  max_steps: 1000\n  total_steps: 5000\n"}, []),
])
def test_specforge_yaml_gives_its_own_total(tmp_path: Path, files: int, fmt: dict, overrides: list[str]) -> None:
    (tmp_path / "run.yaml").write_text(SPECFORGE_YAML.format(**fmt))
    states = tmp_path / "cache" / "hidden_states"
    for i in range(files):
        part = states / f"rows_{i // 40}"
        part.mkdir(parents=True, exist_ok=True)
        (part / f"data_{i}.ckpt{'.gz' if i % 3 == 0 else ''}").write_bytes(b"")
    (states / "README.txt").write_text("not a feature file")
    argv = ["train", "-c", "run.yaml", *overrides]
    real = real_specforge_steps(argv, tmp_path)

    found, facts = host_total(spec(SPECFORGE, argv, tmp_path, fmt["world"]))
    assert found is not None, facts
    assert (found.steps, found.estimate, facts["feature_files"]) == (real, False, files)
    assert found.note.startswith(f"total {real} steps found: ") and f"{files} feature files in " in found.note


def test_specforge_max_steps_on_the_command_line_stays_todays_total(tmp_path: Path) -> None:
    run = spec(SPECFORGE, ["train", "-c", "run.yaml", "training.max_steps=90"], tmp_path)
    assert run.stated_total_steps == 90 and totals_query(run) is None


def test_specforge_runs_it_cannot_total_say_why(tmp_path: Path) -> None:
    # an online run (prompts streamed from a capture server) has no finite data to count: no total
    (tmp_path / "run.yaml").write_text("data:\n  train_data_path: ./sharegpt.jsonl\ntraining:\n  num_epochs: 2\n")
    found, facts = host_total(spec(SPECFORGE, ["train", "--config=run.yaml"], tmp_path))
    assert found is None and "feature_files" not in facts
    # a needed key in a form the host's reader does not take is refused with the reason, never guessed
    (tmp_path / "run.yaml").write_text("base: &b\n  num_epochs: 2\ntraining: *b\n"
                                       "data:\n  hidden_states_path: ./h\n")
    found, facts = host_total(spec(SPECFORGE, ["train", "-c", "run.yaml"], tmp_path))
    assert found is None and "`training` is a value in a form this reader does not take ('*')" in facts["unreadable"]
    # a JSON config is read as SpecForge reads it (not .yaml/.yml: JSON)
    (tmp_path / "h").mkdir()
    for i in range(10):
        (tmp_path / "h" / f"{i}.ckpt").write_bytes(b"")
    (tmp_path / "run.json").write_text(json.dumps({"data": {"hidden_states_path": "./h"},
                                                   "training": {"num_epochs": 3, "batch_size": 2}}))
    found, _ = host_total(spec(SPECFORGE, ["train", "-c", "run.json", "--role", "all"], tmp_path))
    assert found is not None and found.steps == 15


# ---- SpecForge's older scripts/train_eagle3.py: the total it prints ------------------------------------------------

def test_specforge_scripts_printed_total_is_the_runs_total() -> None:
    """scripts/train_eagle3.py prints its computed total with specforge.utils.print_with_rank before its first step
    (`Auto-calculated total_steps: N (num_epochs=E * steps_per_epoch=S)`), then `step N: {...}` lines."""
    import io

    from specforge.utils import print_with_rank

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    logger = logging.getLogger("specforge.utils")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        print_with_rank("Initialized train dataloader")
        print_with_rank(f"Auto-calculated total_steps: {2 * 600} (num_epochs=2 * steps_per_epoch=600)")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue() + "step 50: {'loss': 2.31, 'acc': 0.42}\n"
    got = read_log(text, 0, False, True, LogMetricsConfig())
    assert [r.values for r in got.records] == [{"total_steps": 1200}, {"step": 50, "loss": 2.31, "acc": 0.42}]


# ---- the host's readers on what they may meet -----------------------------------------------------------------------

def test_arrow_reader_takes_the_column_in_any_batch_layout_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    import pyarrow as pa

    rows = 2500
    seq = pa.array([None if i % 97 == 0 else i % 300 for i in range(rows)], type=pa.int32())
    table = pa.table({"input_ids": pa.array([[1, 2]] * rows, type=pa.list_(pa.int64())),
                      "meta": pa.array([{"a": "x", "b": [1]}] * rows), "text": pa.array(["é"] * rows),
                      "seq_len": seq})
    want = [0 if v is None else v for v in seq.to_pylist()]
    for name, writer in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        with writer(str(tmp_path / name), table.schema) as w:
            for batch in table.to_batches(max_chunksize=333):
                w.write_batch(batch)
        assert list(hostside.arrow_column(str(tmp_path / name), "seq_len")) == want
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(str(tmp_path / "z.arrow"), table.schema, options=options) as w:
        w.write_table(table)
    with pytest.raises(hostside.Unreadable, match="compressed"):
        hostside.arrow_column(str(tmp_path / "z.arrow"), "seq_len")
    (tmp_path / "junk.arrow").write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(hostside.Unreadable):
        hostside.arrow_column(str(tmp_path / "junk.arrow"), "seq_len")


def test_yaml_reader_reads_scalars_as_safe_load_and_names_what_it_cannot() -> None:
    import yaml

    text = ("# a recipe\n---\ntraining:\n  num_epochs: 3 # three\n  lr: 1.0e-4\n  name: 'it''s'\n"
            "  path: \"a # b\"\n  flag: yes\n  none: ~\n  list:\n    - 1\n    - 2\n  after: 5\n"
            "  block: |\n    text\n    more\n  flow: {a: 1}\n  big: 1_000\n")
    values, unreadable = hostside.read_yaml(text)
    loaded = yaml.safe_load(text)["training"]
    for key in ("num_epochs", "lr", "name", "path", "flag", "none", "after", "big"):
        assert values[f"training.{key}"] == loaded[key] and type(values[f"training.{key}"]) is type(loaded[key])
    assert set(unreadable) == {"training.list", "training.block", "training.flow"}
    assert math.isclose(values["training.lr"], 1e-4)


def test_a_restart_with_more_epochs_on_the_command_line_is_priced_at_more_steps(tmp_path: Path) -> None:
    from server.eta import Measured, predict_duration

    ran = spec(SPECULATORS, ["train", "--epochs", "3", "--data-path", "d"], tmp_path)
    seconds, how = predict_duration([Measured(ran, sec_per_step=0.5, total_steps=600)],
                                    spec(SPECULATORS, ["train", "--epochs", "6", "--data-path", "d"], tmp_path))
    assert seconds == 1200 * 0.5 and "steps scaled for 6 epochs instead of 3" in how
    seconds, _ = predict_duration([Measured(spec(SPECFORGE, ["train", "-c", "r.yaml"], tmp_path), 0.5, 600)],
                                  spec(SPECFORGE, ["train", "-c", "r.yaml", "training.max_steps=100"], tmp_path))
    assert seconds == 100 * 0.5
