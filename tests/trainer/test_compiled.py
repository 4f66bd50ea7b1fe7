"""`compiled`: eager wherever compiling does not apply, and eager again when the host cannot compile."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer import compiled as compiled_module
from trainer.compiled import compiled, share_dynamic_profile
from trainer.model import DraftConfig

REPO = Path(__file__).resolve().parents[2]
SMALL = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=100, draft_vocab_size=50, target_hidden_size=64,
                    aux_hidden_state_layer_ids=[1, 2, 3], ttt_steps=3)


class CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so that the compile path is taken on this machine."""

    @property
    def is_cuda(self):
        return True


def test_cpu_calls_run_the_function_as_written(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("nothing is compiled on the CPU"))
    double = compiled(lambda x: x * 2)
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(double.on_cuda(torch.ones(3)), torch.full((3,), 2.0))


def test_a_failing_compiler_warns_and_the_call_runs_eagerly(monkeypatch):
    calls = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            calls.append("compiled")
            raise torch._dynamo.exc.TorchDynamoException("no C compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(compiled_module, "ENABLED", True)

    def add_one(x):
        return x + 1

    f = compiled(add_one)
    x = torch.zeros(2).as_subclass(CudaLike)
    with pytest.warns(UserWarning, match="add_one failed, it runs eagerly"):
        assert torch.equal(f.on_cuda(x).as_subclass(torch.Tensor), torch.ones(2))
    assert torch.equal(f.on_cuda(x).as_subclass(torch.Tensor), torch.ones(2))  # no second try, no second warning
    assert calls == ["compiled"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_training_chain_matches_the_eager_one_on_cuda(monkeypatch, packed):
    """The TTT chain with its per-step regions compiled (the GPU training path) against the same chain run
    eagerly: loss, per-step stats and every parameter's gradient, in bf16 autocast as training runs."""
    import copy

    import torch.nn.functional as F

    from trainer.model import DraftConfig, EagleDraft
    from trainer.ttt import TTTObjective, VerifierTargets

    config = DraftConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=512, draft_vocab_size=128,
                         target_hidden_size=256, aux_hidden_state_layer_ids=[1, 2, 3], ttt_steps=4)
    torch.manual_seed(0)
    draft = EagleDraft(config, torch.randn(512, 256) * 0.5).cuda()
    b, s = 2, 96
    hidden_states = torch.randn(b, s, 768, device="cuda")
    input_ids = torch.randint(0, 512, (b, s), device="cuda")
    probs = torch.randn(b, s, 128, device="cuda").mul(3).softmax(-1)
    top = probs.argmax(-1)
    valid = torch.rand(b, s, device="cuda") > 0.2
    targets = VerifierTargets(probs, top, valid)
    packing = {}
    if packed:
        packing = {"documents": ((40, 56), (96,)),
                   "position_ids": torch.stack([torch.cat([torch.arange(40), torch.arange(56)]), torch.arange(96)]).cuda()}
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(compiled_module, "ENABLED", enabled)
        model = copy.deepcopy(draft)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = TTTObjective(model, 4, 0.8)(hidden_states, input_ids, targets, **packing)
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_e, stats_e, grads_e), (loss_c, stats_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=2e-2)
    assert torch.equal(stats_c[:, 1], stats_e[:, 1])  # the same positions trained at every step
    assert sorted(grads_c) == sorted(grads_e) and len(grads_e) >= 9
    for name, grad in grads_e.items():
        cosine = F.cosine_similarity(grads_c[name].flatten().float(), grad.flatten().float(), dim=0)
        assert cosine > 0.995, f"{name}: cosine {cosine:.4f} between the compiled and the eager gradient"


def test_one_job_id_per_draft_architecture_whatever_the_ttt_and_a_users_own_kept():
    def job_id(config: DraftConfig, users: str | None = None) -> str:
        with torch.compiler.config.patch(job_id=users):  # the process's own setting, restored after
            return share_dynamic_profile(config)

    three = job_id(SMALL)
    assert job_id(dataclasses.replace(SMALL, ttt_steps=5)) == three
    assert job_id(dataclasses.replace(SMALL, hidden_size=128)) != three
    assert job_id(SMALL, users="users-own") == "users-own"


PROCESS = textwrap.dedent("""
    import dataclasses, sys, torch
    from tests.trainer.test_compiled import SMALL
    from trainer.compiled import share_dynamic_profile
    share_dynamic_profile(dataclasses.replace(SMALL, ttt_steps=int(sys.argv[1])))
    f = torch.compile(lambda x: (x * 2).sum(0), backend="eager")
    for n in map(int, sys.argv[2].split(",")):
        f(torch.ones(n, 8))
    print(torch._dynamo.utils.counters["stats"]["unique_graphs"])
""")


@pytest.mark.slow  # two processes that import torch
def test_a_restart_at_another_ttt_compiles_the_sizes_its_first_attempt_saw_vary_dynamic_at_once(tmp_path):
    """Dynamo's profile (torch/_dynamo/pgo.py) under the draft's job id: attempt 1 (TTT=3) compiles its first batch's
    size statically, then again dynamic when the next differs; attempt 2 (TTT=5), a new process on the same compile
    cache, compiles once for sizes it has not seen. Dynamo's own "eager" backend: the profile is Dynamo's, whatever
    compiles the graph."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("TORCH_COMPILE_JOB_ID", None)

    def graphs(ttt: int, sizes: str) -> int:
        done = subprocess.run([sys.executable, "-c", PROCESS, str(ttt), sizes], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert graphs(3, "4,5") == 2, "attempt 1: a static graph, then a dynamic one"
    assert graphs(5, "6,7") == 1, "attempt 2: the dynamic graph at once"
