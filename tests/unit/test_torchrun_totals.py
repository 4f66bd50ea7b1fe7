"""Totals of foreign trainers launched through torchrun: `torchrun -m speculators.train ARGS` gets the total
`speculators train ARGS` gets, on the ranks torchrun starts; SpecForge's `torchrun ... scripts/train_eagle3.py`
gets the total the script computes (num_epochs x ceil(len(loader) / accumulation)), counted here with torch's own
DistributedSampler and DataLoader, from its feature files or its JSON Lines rows, or its --total-steps."""

import json
import math
import random
from pathlib import Path

import pytest

from server.log_patterns import launch_ranks
from tests.unit.test_foreign_totals import SPECULATORS, host_total, spec, write_dataset
from worker.log_metrics import totals_query


@pytest.mark.parametrize("launch", [
    ["/venv/bin/torchrun", "--nproc_per_node", "4", "-m", "speculators.train"],
    ["/venv/bin/torchrun", "--nnodes=1", "--nproc-per-node=4", "--standalone", "--module", "speculators.train"],
    ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node=4", "-m", "speculators.train"],
])
def test_torchrun_of_speculators_train_gets_the_total_of_speculators_train(tmp_path: Path, launch: list[str]):
    rng = random.Random(3)
    write_dataset(tmp_path / "data", [rng.randrange(20, 2500) for _ in range(2000)], shards=2)
    argv = ["--verifier-name-or-path", "/v", "--epochs", "2", "--data-path", "data"]
    direct, _ = host_total(spec(SPECULATORS, ["train", *argv], tmp_path, nproc=4))
    # the run's own nproc_per_node is 1: the ranks are torchrun's
    through, facts = host_total(spec(launch[0], [*launch[1:], *argv], tmp_path, nproc=1))
    assert direct is not None and through is not None, facts
    assert through.steps == direct.steps and through.estimate and "4 ranks" in through.note


def test_torchrun_options_it_cannot_know_leave_the_run_ranks():
    assert launch_ranks("torchrun", ["--nnodes", "1:4", "--nproc_per_node", "8", "x.py"], 2) == 2  # elastic
    assert launch_ranks("torchrun", ["--nproc_per_node", "gpu", "x.py"], 3) == 3
    assert launch_ranks("torchrun", ["--nnodes", "2", "--nproc_per_node", "8", "x.py"], 1) == 16
    assert launch_ranks("/opt/train.sh", ["--nproc_per_node", "8"], 1) == 1
    # another module under torchrun is no trainer whose total is read
    assert totals_query(spec("/venv/bin/torchrun", ["-m", "other.train", "--epochs", "3"], Path("/tmp"))) is None


def script_steps(samples: int, world: int, epochs: int, batch: int, accumulation: int, tp: int = 1) -> int:
    """scripts/train_eagle3.py's own count: prepare_dp_dataloaders' DistributedSampler over the dp group and a
    DataLoader of target_batch_size on rank 0, then num_epochs x ceil(len(loader) / draft_accumulation_steps)."""
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = list(range(samples))
    sampler = DistributedSampler(dataset, num_replicas=world // tp, rank=0, shuffle=True)
    loader = DataLoader(dataset, batch_size=tp * batch, sampler=sampler)
    return epochs * math.ceil(len(loader) / accumulation)


def test_torchrun_of_specforge_train_eagle3_counts_its_feature_files(tmp_path: Path):
    for i in range(103):
        (tmp_path / "hs" / f"shard{i % 3}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "hs" / f"shard{i % 3}" / f"data_{i}.ckpt").write_bytes(b"")
    args = ["--nproc_per_node", "4", "scripts/train_eagle3.py", "--target-model-path", "/m",
            "--train-data-path", "d.jsonl", "--train-hidden-states-path", "hs", "--num-epochs", "3",
            "--batch-size", "2", "--draft-accumulation-steps", "2", "--output-dir", "out"]
    found, facts = host_total(spec("/venv/bin/torchrun", args, tmp_path))
    assert facts["feature_files"] == 103
    assert found is not None and found.steps == script_steps(103, 4, 3, 2, 2) == 21 and not found.estimate
    assert "103 feature files over 4 data-parallel ranks" in found.note


def test_specforge_train_eagle3_online_rows_and_stated_totals(tmp_path: Path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"conversations": []}) + "\n" for _ in range(50)) + "\n")
    found, facts = host_total(spec("/usr/bin/python3", ["scripts/train_eagle3.py", "--target-model-path", "/m",
                                              "--train-data-path", "d.jsonl", "--output-dir", "o"], tmp_path))
    # the script's defaults: 10 epochs, batch 1; rows before its dataset's filtering: an estimate
    assert facts["rows"] == 50 and found is not None and found.estimate
    assert found.steps == script_steps(50, 1, 10, 1, 1) == 500
    # a stated total is the command line's, and the host reads nothing
    stated = spec("/w/SpecForge/scripts/train_eagle3.py", ["--train-data-path", "x.jsonl", "--total-steps", "800"],
                  tmp_path)
    assert stated.stated_total_steps == 800 and totals_query(stated) is None
    found, facts = host_total(spec("/venv/bin/torchrun", ["scripts/train_eagle3.py", "--train-data-path", "missing.jsonl"],
                                   tmp_path))
    assert found is None and "is not a file" in facts["unreadable"]
