"""The fused (Triton) TTT loss against the torch ops it replaces: loss, the draft's top-1 and the gradient.

On a GPU the kernels run compiled; on the CPU they run in Triton's interpreter (in a subprocess, since
TRITON_INTERPRET is read when triton is imported), so the same kernel code is checked everywhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
