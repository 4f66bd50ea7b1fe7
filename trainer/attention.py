"""Attention of one TTT step: causal over step-0 keys, plus one diagonal key per later TTT step.

At TTT step k a query at position t sees the step-0 keys at positions <= t and, from every step
1..k, only the key that step produced at position t. Those diagonal keys are one per position, so
their scores are per-position dot products: no (positions x positions x steps) tensor exists.

The causal block runs in a fused kernel that also returns its log-sum-exp; the block and the
diagonal scores are merged in log space. The backward pass hands the kernel the *merged* output
and log-sum-exp (as ring attention does for its blocks), which yields exact gradients without
differentiating through the kernel's log-sum-exp.

Layout: q is [B, Q, heads, d]; keys and values are [B, S, kv_heads, d]; each diagonal entry is
[B, Q, kv_heads, d]. Either Q == S (every position, causal) or Q == 1 (the newest position
only, which sees every key: the draft's chain at inference).

Packed rows (several samples in one sequence) pass `documents`: per row, the lengths of the
samples it holds, in order. The causal block then runs the same fused kernel once per sample, so
no query sees another sample's keys (a block-diagonal causal mask without a mask tensor); the
diagonal keys are per position and need nothing. Without `documents` the path is unchanged.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from trainer.compiled import compiled, compiling


def ttt_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    diag_keys: Sequence[Tensor],
    diag_values: Sequence[Tensor],
    scale: float,
    documents: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """Attention output [B, Q, heads, d] of one TTT step (see the module docstring)."""
    if q.shape[1] not in (1, keys.shape[1]):
        raise ValueError(f"queries must cover every key position or only the last one, got {q.shape[1]} of {keys.shape[1]}")
    if documents is not None and any(sum(row) != q.shape[1] for row in documents):
        raise ValueError(f"the document lengths of each row must add up to its {q.shape[1]} positions")
    return _TTTAttention.apply(scale, documents, q, keys, values, *diag_keys, *diag_values)


def _causal_backend(q: Tensor) -> str:
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "cuda_flash"
    if q.device.type == "cpu":
        return "cpu_flash"
    return "math"


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv_grad(g: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // groups, groups, s, d).sum(2)


def _causal_forward(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool):
    """Inputs [B, heads, S, d]; returns (out [B, heads, Q, d], lse [B, heads, Q] fp32, kernel state)."""
    groups = q.shape[1] // k.shape[1]
    if backend == "cuda_flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, False, scale=scale
        )
        return out, lse[..., : q.shape[2]], (cum_q, cum_k, max_q, max_k, seed, offset)
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    scores = _math_scores(q, _expand_kv(k, groups), scale, causal)
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ _expand_kv(v, groups).float()
    return out.to(q.dtype), lse, None


def _causal_backward(backend: str, grad, q, k, v, out, lse, scale: float, causal: bool, state):
    """Gradients of the causal block given the merged `out` and `lse` of the whole step."""
    groups = q.shape[1] // k.shape[1]
    if backend == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse.contiguous(),
            cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale,
        )
        return dq, _fold_kv_grad(dk, groups), _fold_kv_grad(dv, groups)
    if backend == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )
    ke, ve = _expand_kv(k, groups).float(), _expand_kv(v, groups).float()
    probs = (_math_scores(q, ke, scale, causal) - lse[..., None]).exp()
    grad = grad.float()
    dv = probs.transpose(-1, -2) @ grad
    ds = probs * (grad @ ve.transpose(-1, -2) - (grad * out.float()).sum(-1, keepdim=True))
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    return dq.to(q.dtype), _fold_kv_grad(dk, groups).to(k.dtype), _fold_kv_grad(dv, groups).to(v.dtype)


def _document_parts(documents: Sequence[Sequence[int]]):
    """Index of each document's block in [B, heads, S, d] tensors, row by row."""
    for row, lengths in enumerate(documents):
        start = 0
        for length in lengths:
            yield slice(row, row + 1), slice(None), slice(start, start + length)
            start += length


def _documents_forward(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float, documents):
    """`_causal_forward` run on each document of each row alone: a block-diagonal causal mask."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    states = []
    for part in _document_parts(documents):
        out[part], lse[part], state = _causal_forward(backend, q[part], k[part], v[part], scale, True)
        states.append(state)
    return out, lse, states


def _documents_backward(backend: str, grad, q, k, v, out, lse, scale: float, documents, states):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for part, state in zip(_document_parts(documents), states, strict=True):
        dq[part], dk[part], dv[part] = _causal_backward(
            backend, grad[part], q[part], k[part], v[part], out[part], lse[part], scale, True, state
        )
    return dq, dk, dv


def _math_scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores


def _stack_steps(entries: Sequence[Tensor]) -> Tensor:
    """The diagonal entries [B, Q, kv_heads, d] of the steps so far, stacked [B, Q, kv_heads, n, d], with their count
    n marked dynamic for torch.compile from 2 on (Dynamo specialises a size of 1 whatever it is told). The compiled
    merge and its backward then trace one graph for n = 1 and one for every n above, whatever the TTT depth: an
    attempt restarted at a deeper TTT finds every graph the first attempt compiled in the compile cache. Left to
    itself Dynamo compiles the first n it meets statically, which in the backward pass is the depth's last step
    (n = T - 1): a graph of that depth's own, compiled cold at every new depth. On an H100, TTT=5 after TTT=3 took
    17.1 s to its first step unmarked and 10.3 s marked (benchmarks/bench_startup.py, docs/benchmarks.md). Marking
    a tensor does nothing where nothing is compiled."""
    stacked = torch.stack(tuple(entries), dim=3)
    if stacked.shape[3] > 1:
        torch._dynamo.maybe_mark_dynamic(stacked, 3)
    return stacked


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale: float, documents, q: Tensor, keys: Tensor, values: Tensor, *diag: Tensor) -> Tensor:
        n = len(diag) // 2
        nq = q.shape[1]
        causal = nq > 1
        backend = _causal_backend(q)
        with torch.autocast(q.device.type, enabled=False):
            if documents is None:
                out_c, lse_c, state = _causal_forward(
                    backend, q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale, causal
                )
            else:
                out_c, lse_c, state = _documents_forward(
                    backend, q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale, documents
                )
            if n == 0:
                out, lse = out_c.transpose(1, 2), lse_c
            else:
                merge = _merge_diagonal.on_cuda if q.requires_grad else _merge_diagonal
                out, lse = merge(q, out_c, lse_c, _stack_steps(diag[:n]), _stack_steps(diag[n:]), scale)
        ctx.scale, ctx.causal, ctx.backend, ctx.state, ctx.documents = scale, causal, backend, state, documents
        ctx.compile = compiling()  # the backward runs on autograd's thread: it compiles when this thread does
        ctx.save_for_backward(q, keys, values, out, lse, *diag)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, keys, values, out, lse, *diag = ctx.saved_tensors
        n = len(diag) // 2
        scale = ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            grad = grad.to(out.dtype)
            causal_inputs = (grad.transpose(1, 2), q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                             out.transpose(1, 2), lse, scale)
            if ctx.documents is None:
                dq, dk, dv = _causal_backward(ctx.backend, *causal_inputs, ctx.causal, ctx.state)
            else:
                dq, dk, dv = _documents_backward(ctx.backend, *causal_inputs, ctx.documents, ctx.state)
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
            if n == 0:
                return None, None, dq, dk, dv
            dq, d_diag_k, d_diag_v = _diagonal_backward.on_cuda(
                grad, q, out, lse, dq, _stack_steps(diag[:n]), _stack_steps(diag[n:]), scale, compile=ctx.compile
            )
        return None, None, dq, dk, dv, *d_diag_k.unbind(3), *d_diag_v.unbind(3)


@compiled
def _merge_diagonal(q: Tensor, out_c: Tensor, lse_c: Tensor, diag_k: Tensor, diag_v: Tensor, scale: float):
    """(out [B, Q, heads, d], lse [B, heads, Q]) of the causal block merged with the diagonal keys/values
    [B, Q, kv_heads, n, d], in float32."""
    b, nq, heads, d = q.shape
    shape = (b, nq, diag_k.shape[2], heads // diag_k.shape[2])
    scores = _diag_scores(q, diag_k, scale)
    lse_c_g = lse_c.transpose(1, 2).reshape(shape)
    lse_g = torch.logaddexp(lse_c_g, scores.logsumexp(-1))
    weights = (scores - lse_g[..., None]).exp()
    out = (lse_c_g - lse_g).exp()[..., None] * out_c.transpose(1, 2).reshape(*shape, d).float()
    out = out + torch.einsum("bqkgn,bqknd->bqkgd", weights, diag_v.float())
    return out.reshape(b, nq, heads, d).to(q.dtype), lse_g.reshape(b, nq, heads).transpose(1, 2)


@compiled
def _diagonal_backward(grad: Tensor, q: Tensor, out: Tensor, lse: Tensor, dq: Tensor, diag_k: Tensor,
                       diag_v: Tensor, scale: float):
    """(dq with the diagonal keys' share added, d diag_k, d diag_v), given the merged out and lse."""
    b, nq, heads, d = q.shape
    shape = (b, nq, diag_k.shape[2], heads // diag_k.shape[2])
    diag_k, diag_v = diag_k.float(), diag_v.float()
    scores = _diag_scores(q, diag_k, scale)
    weights = (scores - lse.transpose(1, 2).reshape(shape)[..., None]).exp()
    g = grad.reshape(*shape, d).float()
    g_dot_out = (g * out.reshape(*shape, d).float()).sum(-1, keepdim=True)
    dscores = weights * (torch.einsum("bqkgd,bqknd->bqkgn", g, diag_v) - g_dot_out)
    qg = q.reshape(*shape, d).float()
    dq = dq.float() + scale * torch.einsum("bqkgn,bqknd->bqkgd", dscores, diag_k).reshape(b, nq, heads, d)
    d_diag_k = scale * torch.einsum("bqkgn,bqkgd->bqknd", dscores, qg)
    d_diag_v = torch.einsum("bqkgn,bqkgd->bqknd", weights, g)
    return dq.to(q.dtype), d_diag_k.to(q.dtype), d_diag_v.to(q.dtype)


def _diag_scores(q: Tensor, diag_keys: Tensor, scale: float) -> Tensor:
    """Scores [B, Q, kv_heads, groups, n] of each query against its own position's diagonal keys [B, Q, kv_heads, n, d]."""
    b, nq, heads, d = q.shape
    kv_heads = diag_keys.shape[2]
    qg = q.reshape(b, nq, kv_heads, heads // kv_heads, d).float()
    return torch.einsum("bqkgd,bqknd->bqkgn", qg, diag_keys.float()) * scale
