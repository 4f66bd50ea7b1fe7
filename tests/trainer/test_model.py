"""The draft model: the TTT attention against a dense-mask reference, the whole TTT chain against a
step-by-step implementation of docs/trainer.md, and the engine format on disk."""

import json

import pytest
import torch
import torch.nn.functional as F

import trainer.attention as attention
from trainer.attention import ttt_attention
from trainer.model import DraftConfig, EagleDraft, engine_state_dict, load_draft, save_draft
from trainer.ttt import TTTObjective, VerifierTargets


def dense_ttt_attention(q, keys, values, diag_keys, diag_values, scale):
    """Reference: every step's keys side by side and the full [S, S * (n + 1)] mask."""
    b, s, heads, d = q.shape
    groups = heads // keys.shape[2]
    n = len(diag_keys)
    all_keys = torch.cat([keys, *diag_keys], dim=1).repeat_interleave(groups, dim=2)
    all_values = torch.cat([values, *diag_values], dim=1).repeat_interleave(groups, dim=2)
    mask = torch.zeros(s, s * (n + 1), dtype=torch.bool, device=q.device)
    mask[:, :s] = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    for j in range(1, n + 1):
        mask[:, s * j : s * (j + 1)] = torch.eye(s, dtype=torch.bool, device=q.device)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, all_keys) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), all_values)


def random_attention_inputs(n_diag, heads, kv_heads, s=13, d=8, b=2, dtype=torch.float32):
    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    q = leaf(b, s, heads, d)
    keys, values = leaf(b, s, kv_heads, d), leaf(b, s, kv_heads, d)
    diag_keys = [leaf(b, s, kv_heads, d) for _ in range(n_diag)]
    diag_values = [leaf(b, s, kv_heads, d) for _ in range(n_diag)]
    return q, keys, values, diag_keys, diag_values


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("n_diag", [0, 1, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_ttt_attention_matches_dense_mask_forward_and_gradients(monkeypatch, backend, n_diag, heads, kv_heads):
    monkeypatch.setattr(attention, "_causal_backend", lambda q: backend)
    torch.manual_seed(n_diag * 10 + heads + kv_heads)
    q, keys, values, diag_keys, diag_values = random_attention_inputs(n_diag, heads, kv_heads)
    inputs = [q, keys, values, *diag_keys, *diag_values]
    grad_out = torch.randn_like(q)

    fast = ttt_attention(q, keys, values, diag_keys, diag_values, 0.35)
    fast_grads = torch.autograd.grad(fast, inputs, grad_out)
    dense = dense_ttt_attention(q, keys, values, diag_keys, diag_values, 0.35)
    dense_grads = torch.autograd.grad(dense, inputs, grad_out)

    torch.testing.assert_close(fast, dense, atol=2e-5, rtol=1e-4)
    for got, want in zip(fast_grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def per_document_reference(q, keys, values, diag_keys, diag_values, scale, documents):
    """Dense attention run on every document of every row alone, put back in place."""
    rows = []
    for row, lengths in enumerate(documents):
        parts, start = [], 0
        for n in lengths:
            part = (slice(row, row + 1), slice(start, start + n))
            parts.append(dense_ttt_attention(q[part], keys[part], values[part], [k[part] for k in diag_keys],
                                             [v[part] for v in diag_values], scale))
            start += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def check_packed_attention(q, keys, values, diag_keys, diag_values, documents, atol, rtol, scale=0.35):
    inputs = [q, keys, values, *diag_keys, *diag_values]
    grad_out = torch.randn_like(q)
    fast = ttt_attention(q, keys, values, diag_keys, diag_values, scale, documents)
    fast_grads = torch.autograd.grad(fast, inputs, grad_out)
    wide = [x.detach().float().requires_grad_() for x in inputs]
    n = len(diag_keys)
    want = per_document_reference(wide[0], wide[1], wide[2], wide[3 : 3 + n], wide[3 + n :], scale, documents)
    want_grads = torch.autograd.grad(want, wide, grad_out.float())
    torch.testing.assert_close(fast.float(), want, atol=atol, rtol=rtol)
    for got, expected in zip(fast_grads, want_grads, strict=True):
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)
    unpacked = ttt_attention(q, keys, values, diag_keys, diag_values, scale)  # guard: the mask matters
    assert not torch.allclose(unpacked.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("n_diag", [0, 2])
def test_packed_rows_attend_only_within_each_sample(monkeypatch, backend, n_diag):
    monkeypatch.setattr(attention, "_causal_backend", lambda q: backend)
    torch.manual_seed(n_diag)
    inputs = random_attention_inputs(n_diag, 4, 2, s=13)
    check_packed_attention(*inputs, documents=((5, 8), (1, 4, 6, 2)), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n_diag", [0, 3])
def test_cuda_flash_packed_rows_attend_only_within_each_sample(n_diag):
    torch.manual_seed(0)
    inputs = [x.detach().cuda().to(torch.bfloat16).requires_grad_() for x in _flatten(
        random_attention_inputs(n_diag, 8, 2, s=300, d=128, b=1))]
    q, keys, values = inputs[:3]
    diag_keys, diag_values = inputs[3 : 3 + n_diag], inputs[3 + n_diag :]
    assert attention._causal_backend(q) == "cuda_flash"
    # the model's own scale, as the unpacked CUDA test uses: a sharper softmax puts bf16 gradients past 3e-2
    check_packed_attention(q, keys, values, diag_keys, diag_values, documents=((77, 130, 93),), atol=3e-2, rtol=3e-2,
                           scale=128**-0.5)


def test_ttt_attention_is_stable_when_diagonal_scores_dominate():
    torch.manual_seed(0)
    q, keys, values, diag_keys, diag_values = random_attention_inputs(2, 2, 2)
    with torch.no_grad():
        diag_keys[0].copy_(q * 40)  # scores in the thousands: a naive exp would overflow
    out = ttt_attention(q, keys, values, diag_keys, diag_values, 1.0)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    torch.testing.assert_close(out, diag_values[0].detach(), atol=1e-5, rtol=0)


def test_last_position_query_sees_every_key():
    torch.manual_seed(1)
    q, keys, values, diag_keys, diag_values = random_attention_inputs(2, 4, 2)
    full = ttt_attention(q, keys, values, diag_keys, diag_values, 0.5)
    last = ttt_attention(q[:, -1:], keys, values, [k[:, -1:] for k in diag_keys], [v[:, -1:] for v in diag_values], 0.5)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-5)


def tiny_config(**overrides) -> DraftConfig:
    fields = dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, draft_vocab_size=24, target_hidden_size=32,
        aux_hidden_state_layer_ids=[2, 4, 5], ttt_steps=3,
    )
    fields.update(overrides)
    return DraftConfig(**fields)


def tiny_draft(config: DraftConfig, seed: int = 0) -> EagleDraft:
    torch.manual_seed(seed)
    draft = EagleDraft(config, torch.randn(config.vocab_size, config.hidden_size))
    draft_ids = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    draft.set_vocab_mapping(draft_ids - torch.arange(config.draft_vocab_size), t2d)
    with torch.no_grad():  # non-trivial norms so that a mixed-up norm shows
        for module in draft.modules():
            if hasattr(module, "eps"):
                module.weight.uniform_(0.5, 1.5)
    return draft


def random_targets(b, s, k, seed=0) -> VerifierTargets:
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(b, s, k, generator=g).mul(2).softmax(-1)
    top = probs.argmax(-1)
    valid = torch.rand(b, s, generator=g) < 0.8
    valid[:, -1] = False
    return VerifierTargets(probs, top, valid)


def rope_reference(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def naive_ttt_loss(draft: EagleDraft, hidden_states, input_ids, targets, steps, decay):
    """docs/trainer.md read literally: each step rebuilds its full 2H input from the shifted tokens, keeps every
    step's keys, and attends through a dense mask; targets are picked position by position."""
    cfg, layer = draft.config, draft.midlayer
    attn = layer.self_attn
    b, s = input_ids.shape
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    weight = torch.cat([attn.qkv_token.weight, attn.qkv_hidden.weight], dim=1)  # q/k/v over [emb, hidden]
    hidden = draft.fc(hidden_states)
    keys, values, losses = [], [], []
    total = 0.0
    for k in range(steps):
        tokens = torch.zeros_like(input_ids)
        tokens[:, : s - 1 - k] = input_ids[:, 1 + k :]
        x = torch.cat([layer.input_layernorm(draft.embed_weight[tokens]), layer.hidden_norm(hidden)], dim=-1)
        q, key, value = (x @ weight.T).split([q_size, kv_size, kv_size], dim=-1)
        positions = torch.arange(s) + k
        q = rope_reference(q.view(b, s, cfg.num_attention_heads, cfg.head_dim), positions, cfg.rope_theta)
        keys.append(rope_reference(key.view(b, s, cfg.num_key_value_heads, cfg.head_dim), positions, cfg.rope_theta))
        values.append(value.view(b, s, cfg.num_key_value_heads, cfg.head_dim))
        out = dense_ttt_attention(q, keys[0], values[0], keys[1:], values[1:], cfg.head_dim**-0.5)
        hidden = hidden + attn.o_proj(out.reshape(b, s, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = draft.logits(hidden)
        terms = []
        for row in range(b):
            for t in range(s):
                j = t + 1 + k
                if j < s and targets.valid[row, j]:
                    terms.append(-(targets.probs[row, j] * F.log_softmax(logits[row, t], -1)).sum())
        losses.append(torch.stack(terms).mean())
        total = total + decay**k * losses[-1]
    return total, losses


def test_ttt_chain_matches_step_by_step_reference_loss_and_gradients():
    cfg = tiny_config()
    draft = tiny_draft(cfg)
    b, s, steps = 2, 11, 4
    torch.manual_seed(3)
    hidden_states = torch.randn(b, s, 3 * cfg.hidden_size)
    input_ids = torch.randint(0, cfg.vocab_size, (b, s))
    targets = random_targets(b, s, cfg.draft_vocab_size)
    params = [p for p in draft.parameters() if p.requires_grad]

    loss, stats = TTTObjective(draft, steps, 0.8)(hidden_states, input_ids, targets)
    grads = torch.autograd.grad(loss, params)
    ref_loss, ref_losses = naive_ttt_loss(draft, hidden_states, input_ids, targets, steps, 0.8)
    ref_grads = torch.autograd.grad(ref_loss, params)

    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats[:, 0], torch.stack(ref_losses).detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_engine_format_round_trip(tmp_path):
    cfg = tiny_config()
    draft = tiny_draft(cfg)
    save_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 24 and config["vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: inputs of layers
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: outputs of layers

    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q over [embedding, hidden]
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "norm.weight"} <= tensors.keys()  # 24 of 64 ids: kept
    assert not any("embed" in name for name in tensors)

    loaded = load_draft(tmp_path, draft.embed_weight)
    for name, tensor in engine_state_dict(draft).items():
        torch.testing.assert_close(engine_state_dict(loaded)[name], tensor, atol=0, rtol=0)


def test_a_full_vocabulary_export_drops_the_identity_map_and_reads_back_as_identity(tmp_path):
    """vLLM from 0.30.0 stops at a `d2t` in a draft of the full vocabulary (longrun/draft_releases.py): the
    identity map is not written, and every reader of the export takes its absence as the identity."""
    from safetensors.torch import load_file

    from trainer.checkpoint import export_draft
    from trainer.model import SPECULATORS_DIR, load_draft_weights

    cfg = tiny_config(draft_vocab_size=64)
    draft = tiny_draft(cfg)
    draft.set_vocab_mapping(torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool))
    export_draft(tmp_path, draft, ("engine", "speculators"))
    for directory in (tmp_path, tmp_path / SPECULATORS_DIR):
        tensors = load_file(str(directory / "model.safetensors"))
        assert "lm_head.weight" in tensors and not {"d2t", "t2d"} & tensors.keys()
    loaded = load_draft(tmp_path, draft.embed_weight)
    assert not loaded.d2t.any() and loaded.t2d.all()
    for name, tensor in engine_state_dict(draft).items():
        torch.testing.assert_close(engine_state_dict(loaded)[name], tensor.to(torch.bfloat16).float(), atol=0, rtol=0)
    # a draft holding another mapping gets the identity back (resume, --init-from)
    other = tiny_draft(cfg, seed=1)
    other.set_vocab_mapping(torch.full((64,), 5, dtype=torch.long), torch.zeros(64, dtype=torch.bool))
    load_draft_weights(other, tmp_path)
    assert not other.d2t.any() and other.t2d.all()

    # a full vocabulary in another order is no identity: its map is written and read back
    permuted = tiny_draft(cfg)
    order = torch.randperm(64)
    permuted.set_vocab_mapping(order - torch.arange(64), torch.ones(64, dtype=torch.bool))
    save_draft(permuted, tmp_path / "permuted")
    assert {"d2t", "t2d"} <= load_file(str(tmp_path / "permuted" / "model.safetensors")).keys()
    assert torch.equal(load_draft(tmp_path / "permuted").d2t, order - torch.arange(64))


def test_a_reduced_vocabulary_export_without_its_map_is_refused_on_load(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = tiny_draft(tiny_config())
    save_draft(draft, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["d2t"].shape == (24,) and draft.d2t.any()
    del state["d2t"], state["t2d"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['d2t', 't2d'\]"):
        load_draft(tmp_path)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    plain = EagleDraft(tiny_config(head_dim=64, hidden_size=64, num_attention_heads=1, num_key_value_heads=1))
    scaled = EagleDraft(tiny_config(
        head_dim=64, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ))
    assert torch.equal(plain.inv_freq[:4], scaled.inv_freq[:4])
    torch.testing.assert_close(scaled.inv_freq[-1], plain.inv_freq[-1] / 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n_diag", [0, 3])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 128), (4, 4, 64)])
def test_cuda_flash_ttt_attention_matches_dense_mask(n_diag, heads, kv_heads, d):
    torch.manual_seed(0)
    s = 300  # not a multiple of the kernel's block size
    inputs = [x.detach().cuda().to(torch.bfloat16).requires_grad_() for x in _flatten(
        random_attention_inputs(n_diag, heads, kv_heads, s=s, d=d))]
    q, keys, values = inputs[:3]
    diag_keys, diag_values = inputs[3 : 3 + n_diag], inputs[3 + n_diag :]
    assert attention._causal_backend(q) == "cuda_flash"
    grad_out = torch.randn_like(q)
    fast = ttt_attention(q, keys, values, diag_keys, diag_values, d**-0.5)
    fast_grads = torch.autograd.grad(fast, inputs, grad_out)
    wide = [x.detach().float().requires_grad_() for x in inputs]
    dense = dense_ttt_attention(wide[0], wide[1], wide[2], wide[3 : 3 + n_diag], wide[3 + n_diag :], d**-0.5)
    dense_grads = torch.autograd.grad(dense, wide, grad_out.float())
    torch.testing.assert_close(fast.float(), dense, atol=2e-2, rtol=2e-2)
    for got, want in zip(fast_grads, dense_grads, strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def _flatten(inputs):
    q, keys, values, diag_keys, diag_values = inputs
    return [q, keys, values, *diag_keys, *diag_values]
