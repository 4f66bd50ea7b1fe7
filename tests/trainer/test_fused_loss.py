"""The fused (Triton) TTT loss against the torch ops it replaces: loss, the draft's top-1 and the gradient.

On a GPU the kernels run compiled; on the CPU they run in Triton's interpreter (in a subprocess, since
TRITON_INTERPRET is read when triton is imported), so the same kernel code is checked everywhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import fused_loss
from trainer.fused_loss import soft_cross_entropy

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton", reason="the fused loss needs triton (pip install triton)")


def compare(device: str, dtype: torch.dtype, n: int, k: int, tolerance: float) -> None:
    g = torch.Generator().manual_seed(n * 7 + k)
    logits = (torch.randn(n, k, generator=g) * 3).to(device, dtype)
    # ties: both paths take the first of equal maxima, within a block of columns and across blocks
    logits[1, 3] = logits[1, 5] = logits[1].max() + 1
    logits[0, 3] = logits[0, 3 + 4096 if k > 4099 else k - 4] = logits[0].max() + 1  # 4096: a block of the kernel
    probs = torch.randn(n + 5, k, generator=g).mul(2).softmax(-1).to(device)
    probs[2] *= 0.5  # a row whose targets do not sum to one (renormalised elsewhere, not here)
    rows = torch.randint(0, n + 5, (n,), generator=g)
    rows[0] = 2
    rows = rows.to(device)
    upstream = torch.randn(n, generator=g).to(device)
    results = []
    for fused in (False, True):
        z = logits.clone().requires_grad_()
        loss, top = soft_cross_entropy(z, probs, rows, fused=fused)
        (loss * upstream).sum().backward()
        results.append((loss, top, z.grad))
    (loss_t, top_t, grad_t), (loss_f, top_f, grad_f) = results
    torch.testing.assert_close(loss_f, loss_t, rtol=tolerance, atol=tolerance)
    assert torch.equal(top_f, top_t) and top_f[0] == top_f[1] == 3
    assert grad_f.dtype == dtype
    torch.testing.assert_close(grad_f.float(), grad_t.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n, k", [(257, 32000), (64, 100), (3, 5000)])
def test_fused_loss_matches_torch_ops_on_the_gpu(n, k):
    compare("cuda", torch.bfloat16, n, k, 2e-2)


def test_fused_loss_kernels_match_torch_ops_in_the_interpreter():
    code = ("from tests.trainer.test_fused_loss import compare; import torch\n"
            "for n, k in [(9, 70), (5, 300), (4, 4096 + 33), (3, 3 * 4096)]:\n"
            "    compare('cpu', torch.float32, n, k, 1e-5)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _inputs(n=6, k=40):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, k, generator=g)
    probs = torch.randn(n + 2, k, generator=g).softmax(-1)
    return logits, probs, torch.randint(0, n + 2, (n,), generator=g)


def _loss_and_grad(logits, probs, rows, fused):
    z = logits.clone().requires_grad_()
    loss, top = soft_cross_entropy(z, probs, rows, fused=fused)
    loss.sum().backward()
    return loss.detach(), top, z.grad


def assert_fused_falls_back(which: str) -> None:
    """The fused call warns that its `which` kernel could not run, and gives the torch ops' loss, top-1 and gradient."""
    logits, probs, rows = _inputs()
    want = _loss_and_grad(logits, probs, rows, fused=False)
    with pytest.warns(UserWarning, match=rf"fused TTT loss \({which}\) could not run here"):
        got = _loss_and_grad(logits, probs, rows, fused=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_kernels_that_cannot_run_here_warn_once_and_the_torch_ops_take_over(monkeypatch):
    """CPU tensors outside Triton's interpreter: the kernels cannot launch, as on a host without a compiler."""
    monkeypatch.setattr(fused_loss, "_KERNELS_WORK", {"forward": None, "backward": None})
    assert_fused_falls_back("forward")
    assert fused_loss._KERNELS_WORK["forward"] is False  # `fused_available` now says no: a run does not retry


def test_a_backward_kernel_that_cannot_run_falls_back_to_the_torch_gradient(monkeypatch):
    class ForwardInTorch:  # the forward kernel's outputs, written with torch ops (it "runs")
        def __getitem__(self, grid):
            def run(z, _zs, p, _ps, rows, loss, lse, psum, top, _k, BLOCK, num_warps):
                target = p[rows]
                lse.copy_(z.float().logsumexp(-1))
                psum.copy_(target.sum(-1))
                loss.copy_(lse * psum - (target * z.float()).sum(-1))
                top.copy_(z.argmax(-1))
            return run

    monkeypatch.setattr(fused_loss, "_forward_kernel", ForwardInTorch())
    monkeypatch.setattr(fused_loss, "_KERNELS_WORK", {"forward": None, "backward": None})
    assert_fused_falls_back("backward")
    assert fused_loss._KERNELS_WORK == {"forward": True, "backward": False}
