"""A tiny verifier and its captured features, built locally in seconds (nothing downloaded).

The verifier is a random Llama whose embeddings dominate its residual stream and whose lm_head is
sharp: its next-token distributions depend mostly on the current token and a little on the context,
which a draft can learn from a few thousand tokens. Samples are drawn from the
verifier itself, so the frequency-built draft vocabulary covers most of its top-1 predictions.
"""

# torch and transformers are imported by the functions that build (a test module importing this one at collection
# pays nothing for them: most pytest processes that collect it never build)
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 512, 64, 8, 192


def build_verifier(path: Path, seed: int = 0) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # embeddings dominate the residual stream, and the lm_head is sharp
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def build_dataset(verifier: LlamaForCausalLM, out: Path, samples: int = 24, length: int = 48, seed: int = 0) -> None:
    """out/hidden_states/sample_XXXXXX.safetensors and out/vocab_mapping/, as `trainer.prepare` lays them out."""
    import torch
    from safetensors.torch import save_file

    from trainer.verifier_model import capture_hidden_states, default_layer_ids
    from trainer.vocab import build_vocab_mapping, save_vocab_mapping

    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (samples, 1), generator=g)
        for _ in range(length - 1):
            logits = verifier(input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], dim=1)
        layer_ids = default_layer_ids(LAYERS)
        aux, last = capture_hidden_states(verifier, ids, torch.ones_like(ids), layer_ids)
        (out / "hidden_states").mkdir(parents=True, exist_ok=True)
        for i in range(samples):
            loss_mask = torch.ones(length, dtype=torch.uint8)
            loss_mask[:4] = 0  # a short "prompt"
            save_file(
                {
                    "input_ids": ids[i].clone(),
                    "loss_mask": loss_mask,
                    "hidden_states": aux[i].to(torch.bfloat16).contiguous(),
                    "last_hidden_state": last[i].to(torch.bfloat16).contiguous(),
                },
                str(out / "hidden_states" / f"sample_{i:06d}.safetensors"),
            )
        d2t, t2d = build_vocab_mapping(ids.flatten(), VOCAB, DRAFT_VOCAB)
        save_vocab_mapping(out / "vocab_mapping", d2t, t2d)


def build_all(root: Path) -> dict[str, Path]:
    verifier = build_verifier(root / "verifier")
    build_dataset(verifier, root / "data")
    return {"verifier": root / "verifier", "data": root / "data" / "hidden_states", "vocab": root / "data" / "vocab_mapping"}
