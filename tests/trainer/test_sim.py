"""Simulated acceptance (`--sim-depth`): chain drafting on the validation data past the trained depth, reported
as `sim_acc_k` and `sim_tau_d` at every validation."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.test_ttt import PositionEcho, one_hot_targets
from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.model import DraftConfig, EagleDraft
from trainer.simulate import SimulatedChain, simulated_metrics
from trainer.train import main as train_main
from trainer.ttt import TTTObjective, VerifierTargets

DEPTH = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_sim")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verifier = build_verifier(root / "verifier")
    build_dataset(verifier, root / "data", samples=40)
    torch.set_num_threads(threads)
    return {"verifier": root / "verifier", "data": root / "data" / "hidden_states", "vocab": root / "data" / "vocab_mapping"}


def train(tiny, out: Path, *flags: str) -> list[dict]:
    """In-process training on the tiny data; its validation lines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main([
            "--verifier-path", str(tiny["verifier"]), "--data-dir", str(tiny["data"]),
            "--vocab-mapping-dir", str(tiny["vocab"]), "--output-dir", str(out), "--epochs", "3", "--lr", "3e-3",
            "--max-seq-len", "48", "--num-workers", "0", "--ttt-steps", "3", "--val-ratio", "0.15", *flags,
        ]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "val_loss" in x]


def test_every_validation_reports_acceptance_and_tau_at_every_depth(tiny, tmp_path):
    validations = train(tiny, tmp_path / "out")
    assert len(validations) == 3, "one validation per epoch"
    for record in validations:
        accs = [record[f"sim_acc_{k}"] for k in range(1, DEPTH + 1)]
        taus = [record[f"sim_tau_{d}"] for d in range(1, DEPTH + 1)]
        assert f"sim_acc_{DEPTH + 1}" not in record
        assert all(0.0 <= a <= 1.0 for a in accs)
        assert taus == sorted(taus) and 1.0 <= taus[0] and taus[-1] <= 1 + DEPTH
        assert taus[0] == pytest.approx(1 + accs[0])
        assert taus[2] == pytest.approx(1 + accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2])
    first, last = validations[0], validations[-1]
    assert last["sim_acc_1"] > 0.1 and last["sim_tau_16"] > first["sim_tau_16"], "training raises the acceptance"


def test_sim_depth_0_turns_it_off_and_a_smaller_depth_reports_that_many(tiny, tmp_path):
    off = train(tiny, tmp_path / "off", "--sim-depth", "0", "--epochs", "1")
    assert off and not any(k.startswith("sim_") for k in off[-1])
    four = train(tiny, tmp_path / "four", "--sim-depth", "4", "--epochs", "1", "--sim-samples", "2")
    assert sorted(k for k in four[-1] if k.startswith("sim_")) == sorted(
        f"{base}_{k}" for base in ("sim_acc", "sim_tau", "sim_step_acc", "sim_rounds", "sim_scored")
        for k in range(1, 5))


def simulate(objective: TTTObjective, targets: VerifierTargets, loss_mask, depth, input_ids, features,
             position_ids=None, documents=None) -> torch.Tensor:
    chain = SimulatedChain(objective.draft, targets, loss_mask, depth, position_ids)
    with torch.no_grad():
        objective(features, input_ids, targets, position_ids=position_ids, documents=documents, observer=chain)
    return chain.counts


def test_a_draft_that_predicts_what_the_verifier_does_is_accepted_at_every_depth():
    """The position echo's step k at position t proposes exactly the verifier's top-1 at t+1+k, past its
    trained depth too: every round runs to the end of the sample (or to the depth)."""
    vocab, b, s, steps = 7, 2, 30, 3
    objective = TTTObjective(PositionEcho(vocab), steps)
    targets = one_hot_targets(b, s, vocab)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    counts = simulate(objective, targets, loss_mask, DEPTH, torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, 3))
    metrics = simulated_metrics(counts)
    assert [metrics[f"sim_acc_{k}"] for k in range(1, DEPTH + 1)] == [1.0] * DEPTH
    assert metrics["sim_tau_16"] == 17.0 and metrics["sim_tau_5"] == 6.0
    # position t reaches proposal k (token t+1+k, 1-based k) while that token is in the sample
    assert counts[:, 0].tolist() == [b * (s - 1 - k) for k in range(1, DEPTH + 1)]

    wrong = VerifierTargets(targets.probs, (targets.top + 1) % vocab, targets.valid)  # the verifier says otherwise
    metrics = simulated_metrics(simulate(objective, wrong, loss_mask, DEPTH, torch.zeros(b, s, dtype=torch.long),
                                         torch.zeros(b, s, 3)))
    assert metrics["sim_acc_1"] == 0.0 and metrics["sim_tau_16"] == 1.0


def constant_draft(vocab: int = 64, draft_vocab: int = 8, hidden: int = 16) -> EagleDraft:
    """A real draft whose hidden state stays zero (fc and o_proj zero), so that it proposes draft id 0 everywhere."""
    config = DraftConfig(hidden_size=hidden, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab,
                         draft_vocab_size=draft_vocab, target_hidden_size=hidden, aux_hidden_state_layer_ids=[1, 2, 3])
    torch.manual_seed(0)
    draft = EagleDraft(config, torch.randn(vocab, hidden))
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.midlayer.self_attn.o_proj.weight.zero_()
    return draft


def reference_counts(top: torch.Tensor, loss_mask: torch.Tensor, sample_of: torch.Tensor, depth: int) -> torch.Tensor:
    """Rounds walked one by one for a draft that proposes draft id 0: the round at position t proposes the tokens
    t+2, t+3, ...; proposal k is reached when the earlier ones were accepted and its token is trained text of t's
    sample, and accepted when the verifier's top-1 there (at position t+1+k) is draft id 0. Every round whose token
    t+2+k is such text is scored at k, and right there when that top-1 is draft id 0, whatever came before."""
    counts = torch.zeros(depth, 4)
    b, s = top.shape
    for row in range(b):
        for t in range(s):
            alive = True
            for k in range(depth):
                token = t + 2 + k
                if token >= s or not loss_mask[row, token] or sample_of[row, token] != sample_of[row, t]:
                    break
                right = bool(top[row, t + 1 + k] == 0)
                counts[k, 0] += alive
                counts[k, 1] += alive and right
                counts[k, 2] += 1
                counts[k, 3] += right
                alive = alive and right
    return counts


@pytest.mark.parametrize("packed", [False, True])
def test_counts_follow_each_round_until_its_first_rejection(packed):
    """Conditional acceptance by position, against a round-by-round walk: a masked token ends a round, a top-1
    outside the draft vocabulary (-1) is a rejection, and in packed rows a round never crosses into the next
    sample."""
    draft = constant_draft()
    b, s, steps = 2, 40, 2
    g = torch.Generator().manual_seed(1)
    top = torch.where(torch.rand(b, s, generator=g) < 0.95, 0, torch.randint(-1, 1, (b, s), generator=g) * 2 + 1)  # -1 or 1
    loss_mask = (torch.rand(b, s, generator=g) < 0.98).long()
    loss_mask[:, :3] = 0
    targets = VerifierTargets(F.one_hot(top.clamp(min=0), 8).float(), top, F.pad(loss_mask[:, 1:].bool(), (0, 1)) & (top >= 0))
    ids = torch.randint(0, 64, (b, s), generator=g)
    features = torch.randn(b, s, 48, generator=g)
    documents = ((15, 25), (40,)) if packed else None
    sample_of = torch.zeros(b, s, dtype=torch.long)
    position_ids = None
    if packed:
        sample_of[0, 15:] = 1
        position_ids = torch.stack([torch.cat([torch.arange(15), torch.arange(25)]), torch.arange(40)])
    counts = simulate(TTTObjective(draft, steps), targets, loss_mask, DEPTH, ids, features, position_ids, documents)
    want = reference_counts(top, loss_mask, sample_of, DEPTH)
    assert want[DEPTH - 1, 0] > 0, "some rounds reach the last position"
    assert torch.equal(counts, want)


def test_sim_acc_is_biased_by_its_survivors_and_sim_step_acc_is_not():
    """Two kinds of text, half easy (the draft right at 95 % of positions) and half hard (50 %), the same at every
    depth: the draft's true acceptance at position k is their mean, 0.725, at every k. The rounds that survive to
    position k are mostly easy ones, so the conditional rate (sim_acc_k, the only rate before) climbs with depth
    towards 0.95, as if the draft got better deeper; the rate over every round (sim_step_acc_k) stays at the true
    one."""
    draft = constant_draft()
    b, s, steps, depth = 8, 400, 2, 8
    g = torch.Generator().manual_seed(3)
    easy = torch.arange(b)[:, None] % 2 == 0
    right = torch.rand(b, s, generator=g) < torch.where(easy, 0.95, 0.5)
    top = torch.where(right, 0, 1)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    targets = VerifierTargets(F.one_hot(top, 8).float(), top, F.pad(loss_mask[:, 1:].bool(), (0, 1)))
    counts = simulate(TTTObjective(draft, steps), targets, loss_mask, depth, torch.zeros(b, s, dtype=torch.long),
                      torch.randn(b, s, 48, generator=g))
    metrics = simulated_metrics(counts)
    conditional = [metrics[f"sim_acc_{k}"] for k in range(1, depth + 1)]
    step = [metrics[f"sim_step_acc_{k}"] for k in range(1, depth + 1)]
    true = [right[:, k : s - 1].float().mean().item() for k in range(1, depth + 1)]  # proposal k: top-1 at t+k
    assert step == pytest.approx(true, abs=1e-6), "every round scored: the rate of the text itself"
    assert all(abs(a - 0.725) < 0.03 for a in step)
    assert conditional[0] == pytest.approx(step[0], abs=1e-6), "at position 1 every round is a survivor"
    assert conditional[-1] > 0.88 and conditional == sorted(conditional), "the old rate: survivors are the easy text"
    # τ still rests on the conditional rates (the chain rule holds for them); the counts behind each rate are there
    assert metrics["sim_tau_2"] == pytest.approx(1 + conditional[0] + conditional[0] * conditional[1])
    assert metrics["sim_rounds_1"] == metrics["sim_scored_1"] == b * (s - 2)
    assert metrics[f"sim_rounds_{depth}"] < metrics[f"sim_scored_{depth}"] / 2


@pytest.mark.slow  # a real server running the bundled trainer
def test_simulated_acceptance_streams_through_the_api_for_a_bundled_trainer_run(
        service, tiny_verifier: Path, prepared_data: Path) -> None:
    # one rank: what it asserts (the metrics, stored and streamed) holds for one rank as for two, and one rank runs
    # without torchrun (worker/jobs.py), a torch start-up or two fewer; two-rank served runs, which simulate at every
    # validation too (sim_depth is on by default), are tests/trainer/test_service_trainer.py's
    spec = {"name": "eagle3-sim", "host": "local", "nproc_per_node": 1,
            "trainer": {"verifier_path": str(tiny_verifier), "data_dir": str(prepared_data / "hidden_states"),
                        "vocab_mapping_dir": str(prepared_data / "vocab_mapping"),
                        "output_dir": str(service.workspace / "out"), "epochs": 3, "lr": 3e-3, "max_seq_len": 64,
                        "num_workers": 0, "ttt_steps": 3, "val_ratio": 0.2}}
    run = service.submit(spec)
    live = service.wait(run["id"], lambda r: "sim_tau_16" in r["latest"] or r["status"] in ("succeeded", "failed"),
                        timeout=300, what="a validation with simulated acceptance")
    assert "sim_tau_16" in live["latest"], service.logs(run["id"], tail=40)
    assert service.wait_status(run["id"], "succeeded", "failed", timeout=300)["status"] == "succeeded"
    names = [f"sim_acc_{k}" for k in range(1, DEPTH + 1)] + [f"sim_tau_{d}" for d in range(1, DEPTH + 1)]
    r = service.client.get(f"/v1/runs/{run['id']}/metrics", params={"names": ",".join(names)})
    assert r.status_code == 200, r.text
    series = r.json()["series"]
    assert set(series) == set(names)
    for name in names:
        points = series[name]
        assert len(points) == 3, f"{name}: one point per validation (an epoch end)"
        assert all((0 <= p["value"] <= 1) if name.startswith("sim_acc") else (1 <= p["value"] <= 1 + DEPTH)
                   for p in points)
    taus = [series[f"sim_tau_{d}"][-1]["value"] for d in range(1, DEPTH + 1)]
    assert taus == sorted(taus)
    losses = service.series(run["id"], "val_loss")
    assert [p["step"] for p in losses] == [p["step"] for p in series["sim_tau_16"]], "they stream with val_loss"
    streamed = [e for e in service.events(run["id"]) if "sim_tau_16" in json.dumps(e)]
    assert len(streamed) >= 1, "the run's event stream (SSE) carries them too"

    # --sim-depth 0 turning it off: test_sim_depth_0_turns_it_off_and_a_smaller_depth_reports_that_many, in-process
