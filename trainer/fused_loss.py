"""The TTT loss of one step, fused on the GPU: soft cross-entropy of the draft's logits against the
verifier's distributions, and the draft's top-1, in one pass over the logits forward and one backward.

Per row n of the logits z [N, K] and its target row p = probs[rows[n]] of a shared table [M, K]:
    loss_n = logsumexp(z_n) * sum(p) - p . z_n          top_n = argmax(z_n) (the first of equal maxima)
    d loss_n / d z_n = softmax(z_n) * sum(p) - p

Written with torch ops this is ten or more passes over [N, K] tensors, several in float32 (the cast, the
gathered targets, their product, the softmax of the backward): at 8192 positions x 32k draft tokens each pass
moves about 1 GB, milliseconds per TTT step. The Triton kernels read the bf16 logits and the targets once
each way and write the gradient once. Where Triton cannot run (no GPU, no triton) `soft_cross_entropy`
falls back to the torch ops; `LONGRUN_FUSED_LOSS=0` asks for them on the GPU too. A host where the kernels
cannot be built (no C compiler for Triton's launcher, say) warns once and goes on with the torch ops.
"""

import os
import warnings

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the trainer runs without triton (CPU hosts); the torch path below is then used
    triton = None

FUSED_LOSS_ENV = "LONGRUN_FUSED_LOSS"
ENABLED = triton is not None and os.environ.get(FUSED_LOSS_ENV, "1") != "0"


# whether the kernels have been built and run on this host (None: not tried yet; False: they failed)
_KERNELS_WORK: dict[str, bool | None] = {"forward": None, "backward": None}


def fused_available(logits: Tensor) -> bool:
    return ENABLED and logits.is_cuda and _KERNELS_WORK["forward"] is not False


def _first_launch(which: str, launch) -> bool:
    """Runs `launch()`; the first time, a failure (the kernel cannot be built here) warns and returns False,
    and the torch ops take over for the rest of the run. Later failures are real errors and propagate."""
    try:
        launch()
    except Exception as e:  # noqa: BLE001 - a compiler or driver error at the first build; the torch path is exact
        if _KERNELS_WORK[which]:
            raise
        _KERNELS_WORK[which] = False
        warnings.warn(f"the fused TTT loss ({which}) could not run here, the torch ops take over: "
                      f"{type(e).__name__}: {str(e)[:300]}", stacklevel=3)
        return False
    _KERNELS_WORK[which] = True
    return True


if triton is not None:

    @triton.jit
    def _forward_kernel(z_ptr, z_stride, p_ptr, p_stride, rows_ptr, loss_ptr, lse_ptr, psum_ptr, top_ptr, K: tl.constexpr,
                        BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + n).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        # per-lane running max (= the lane's best logit), sum of exp relative to it, its first index,
        # and the target's mass and dot product
        m = tl.full([BLOCK], -1e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.zeros([BLOCK], tl.int32)
        psum = tl.zeros([BLOCK], tl.float32)
        pz = tl.zeros([BLOCK], tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + offsets
            inside = cols < K
            z = tl.load(z_ptr + n * z_stride + cols, mask=inside, other=-1e30).to(tl.float32)
            p = tl.load(p_ptr + row * p_stride + cols, mask=inside, other=0.0).to(tl.float32)
            higher = z > m
            best = tl.where(higher, cols, best)
            new_m = tl.maximum(m, z)
            s = s * tl.exp(m - new_m) + tl.exp(z - new_m)
            m = new_m
            psum += p
            pz += p * z
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - row_max), 0)
        lse = row_max + tl.log(total)
        mass = tl.sum(psum, 0)
        tl.store(loss_ptr + n, lse * mass - tl.sum(pz, 0))
        tl.store(lse_ptr + n, lse)
        tl.store(psum_ptr + n, mass)
        tl.store(top_ptr + n, tl.min(tl.where(m == row_max, best, K), 0))

    @triton.jit
    def _backward_kernel(grad_ptr, z_ptr, z_stride, p_ptr, p_stride, rows_ptr, lse_ptr, psum_ptr, out_ptr,
                         out_stride, K: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + n).to(tl.int64)
        g = tl.load(grad_ptr + n)
        lse = tl.load(lse_ptr + n)
        mass = tl.load(psum_ptr + n)
        offsets = tl.arange(0, BLOCK)
        for start in range(0, K, BLOCK):
            cols = start + offsets
            inside = cols < K
            z = tl.load(z_ptr + n * z_stride + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + row * p_stride + cols, mask=inside, other=0.0).to(tl.float32)
            d = (tl.exp(z - lse) * mass - p) * g
            tl.store(out_ptr + n * out_stride + cols, d.to(out_ptr.dtype.element_ty), mask=inside)


def _block(k: int) -> tuple[int, int]:
    block = min(4096, triton.next_power_of_2(k))
    return block, 8 if block >= 2048 else 4


class _FusedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, rows: Tensor):
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        probs = probs if probs.stride(-1) == 1 else probs.contiguous()
        n, k = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse, psum = torch.empty_like(loss), torch.empty_like(loss)
        top = torch.empty(n, dtype=torch.int32, device=logits.device)
        block, warps = _block(k)
        ctx.fused = not n or _first_launch("forward", lambda: _forward_kernel[(n,)](
            logits, logits.stride(0), probs, probs.stride(0), rows, loss, lse, psum, top, k,
            BLOCK=block, num_warps=warps))
        if not ctx.fused:
            return _SoftCrossEntropy.forward(ctx, logits, probs, rows)
        ctx.save_for_backward(logits, probs, rows, lse, psum)
        ctx.mark_non_differentiable(top)
        return loss, top.long()

    @staticmethod
    def backward(ctx, grad: Tensor, _top_grad):
        if not ctx.fused:  # the forward fell back to the torch ops
            return _SoftCrossEntropy.backward(ctx, grad, _top_grad)
        logits, probs, rows, lse, psum = ctx.saved_tensors
        n, k = logits.shape
        out = torch.empty_like(logits)
        block, warps = _block(k)
        if n and not _first_launch("backward", lambda: _backward_kernel[(n,)](
                grad.float().contiguous(), logits, logits.stride(0), probs, probs.stride(0), rows, lse, psum, out,
                out.stride(0), k, BLOCK=block, num_warps=warps)):
            return _soft_cross_entropy_grad(logits, probs, rows, lse, grad), None, None
        return out, None, None


class _SoftCrossEntropy(torch.autograd.Function):
    """The same with torch ops. Saves only the logits and the row indices (not a per-step copy of the
    targets), and recomputes the softmax in the backward pass."""

    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, rows: Tensor):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        p = probs[rows]
        lse = z.logsumexp(-1)
        ctx.save_for_backward(logits, probs, rows, lse)
        top = logits.argmax(-1)
        ctx.mark_non_differentiable(top)
        return lse * p.sum(-1) - (p * z).sum(-1), top

    @staticmethod
    def backward(ctx, grad: Tensor, _top_grad):
        logits, probs, rows, lse = ctx.saved_tensors
        return _soft_cross_entropy_grad(logits, probs, rows, lse, grad), None, None


def _soft_cross_entropy_grad(logits: Tensor, probs: Tensor, rows: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    p = probs[rows]
    softmax = (logits.to(lse.dtype) - lse[:, None]).exp()
    return ((softmax * p.sum(-1, keepdim=True) - p) * grad[:, None]).to(logits.dtype)


def soft_cross_entropy(logits: Tensor, probs: Tensor, rows: Tensor, fused: bool | None = None) -> tuple[Tensor, Tensor]:
    """(per-row cross-entropy of logits [N, K] against the distributions probs[rows] ([M, K] indexed by [N]),
    each row's argmax). `fused=None` takes the Triton kernels wherever they can run."""
    if fused is None:
        fused = fused_available(logits)
    return (_FusedSoftCrossEntropy if fused else _SoftCrossEntropy).apply(logits, probs, rows)
