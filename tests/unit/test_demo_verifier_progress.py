"""The demo verifier's training, the first thing `make demo` does, prints progress with the time so far and an ETA
(it ran for minutes without a word)."""

import re
from dataclasses import replace

from trainer import demo_verifier
from trainer.demo_verifier import PRESETS, _train


def test_the_verifiers_training_prints_its_progress_and_an_eta(capsys, monkeypatch) -> None:
    # torch and transformers' Llama here, not at collection: some seconds of CPU in every pytest process that collects
    # this module, most of which never run it
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    clock = iter(range(0, 10_000, 4))  # each look at the clock 4 s later: a slow, busy machine
    monkeypatch.setattr(demo_verifier.time, "monotonic", lambda: next(clock))
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    preset = replace(PRESETS["tiny"], vocab_size=64, seq_len=8, batch_size=2, steps=20)
    _train(LlamaForCausalLM(config), torch.randint(0, 64, (200,)), preset, 0, torch.device("cpu"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "toy verifier: training 20 steps of 2 x 8 tokens on cpu"
    progress = [line for line in lines if line.startswith("toy verifier: step ")]
    # every 15 s of a slow machine, and at each tenth of the steps (here every 2nd)
    assert re.fullmatch(r"toy verifier: step 2/20 \(10%\) loss \d+\.\d{3}, 8s so far, ETA 1m 12s", progress[0])
    assert progress[-1].startswith("toy verifier: step 20/20 (100%)") and "ETA" not in progress[-1]
    assert len(progress) == 10
