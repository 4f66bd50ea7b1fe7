"""`--export-format speculators`: speculators' own classes (speculators 0.9.0, CPU) load longrun's export with its
capture layers, and their forward gives longrun's logits at every TTT step; EAGLE 3.1 (`--fc-norm`,
`--norm-output`) is trained, exported in each convention and read back."""

# speculators is imported by the test that loads its classes: its import runs torch.compile's decorators (about 4 s of
# CPU), which every pytest process collecting this module paid, most of them never running it
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.trainer.test_train import TTT_STEPS, tiny, train_command  # noqa: F401 (fixtures)
from trainer.formats import open_training_data
from trainer.model import load_draft
from trainer.ttt import unroll
from trainer.verifier_model import load_verifier_head
from trainer.vocab import load_vocab_mapping

if TYPE_CHECKING:
    from speculators.models.eagle3 import Eagle3DraftModel


def train(in_process, tiny: dict[str, Path], out: Path, eagle31: bool = False, **flags) -> Path:  # noqa: F811
    flags = {"epochs": 1, "max_steps": 6, "val_ratio": 0, "export_format": "engine,speculators", "fc_norm": eagle31 or None,
             "norm_output": eagle31 or None, **flags}
    assert in_process(train_command(tiny, out, **flags)) == 0
    return out


def speculators_step_logits(model: Eagle3DraftModel, features: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """speculators' own Eagle3 forward over one sample (its TTT loop), the lm_head's output at each step."""
    logits = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    try:
        s = ids.numel()
        # speculators' step 0 reads token t+1 at position t, as longrun's does: hand it the shifted tokens
        next_ids = torch.cat([ids[1:], ids.new_zeros(1)])[None]
        model(features[None], next_ids, document_ids=torch.zeros(1, s, dtype=torch.long),
              position_ids=torch.arange(s)[None], ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return [x[0] for x in logits]


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_speculators_loads_the_export_and_matches_longruns_logits(tiny, tmp_path, in_process, eagle31):  # noqa: F811
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    out = train(in_process, tiny, tmp_path / "out", eagle31)
    layer_ids = open_training_data(tiny["data"], "auto", 8).layer_ids

    config = Eagle3SpeculatorConfig.from_pretrained(out / "speculators")
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, needs a GPU
    model = Eagle3DraftModel.from_pretrained(out / "speculators", config=config).float().eval()
    assert model.config.eagle_aux_hidden_state_layer_ids == layer_ids
    assert (model.config.fc_norm, model.config.norm_output) == (eagle31, eagle31)

    _, embed = load_verifier_head(tiny["verifier"], *load_vocab_mapping(tiny["vocab"]))
    # the same bf16 export, computed in fp32 as speculators' is; the export holds the verifier's embedding in the
    # export's dtype
    draft = load_draft(out, embed.bfloat16().float()).eval()
    assert (draft.config.fc_norm, draft.config.norm_output) == (eagle31, eagle31)
    sample = next(iter(sorted(tiny["data"].glob("sample_*.safetensors"))))
    tensors = load_file(str(sample))
    features, ids = tensors["hidden_states"].float(), tensors["input_ids"].long()
    with torch.no_grad():
        ours = [draft.logits(h)[0] for h in unroll(draft, features[None], ids[None], TTT_STEPS)]
        theirs = speculators_step_logits(model, features, ids)
    assert len(theirs) == TTT_STEPS
    s = ids.numel()
    for k in range(TTT_STEPS):
        valid = s - 1 - k  # positions whose token input lies inside the sample at step k
        torch.testing.assert_close(theirs[k][:valid], ours[k][:valid], atol=1e-5, rtol=1e-5, msg=f"step {k}")
        assert torch.equal(theirs[k][:valid].argmax(-1), ours[k][:valid].argmax(-1))


def test_eagle31_flags_are_written_in_each_convention(tiny, tmp_path, in_process):  # noqa: F811
    out = train(in_process, tiny, tmp_path / "out", eagle31=True)
    engine = json.loads((out / "config.json").read_text())
    speculators = json.loads((out / "speculators" / "config.json").read_text())
    assert (engine["fc_norm"], engine["norm_output"]) == (True, True)  # what speculators' converter reads
    assert (speculators["fc_norm"], speculators["norm_output"], speculators["norm_before_residual"]) == (True, True, False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(f.keys())
    # a relaunch into the same output dir resumes the EAGLE 3.1 draft from its checkpoint
    train(in_process, tiny, out, eagle31=True, max_steps=8)
    assert json.loads((out / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())["step"] == 8
