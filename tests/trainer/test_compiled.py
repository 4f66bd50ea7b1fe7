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


def test_background_compile_compiles_on_its_thread_while_the_training_thread_runs_as_written(monkeypatch):
    """While a BackgroundCompile rehearses, a region called on the training thread runs as written; after
    `take_over` the training thread runs the graph the rehearsal compiled, compiling nothing itself."""
    import threading

    from trainer.compiled import BackgroundCompile

    ran, traced = [], []
    real_compile = torch.compile

    def backend(gm, example_inputs):
        traced.append(threading.current_thread().name)

        def run(*args):
            ran.append(threading.current_thread().name)
            return gm.forward(*args)
        return run

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend, **kw))
    monkeypatch.setattr(compiled_module, "ENABLED", True)
    torch._dynamo.reset()

    def triple(x):
        return x * 3

    region = compiled(triple)
    x = torch.ones(4).as_subclass(CudaLike)
    rehearsed, release = threading.Event(), threading.Event()

    def rehearse():
        region.on_cuda(x)
        rehearsed.set()
        assert release.wait(30)

    background = BackgroundCompile(rehearse)
    try:
        assert rehearsed.wait(60)
        assert torch.equal(region.on_cuda(x).as_subclass(torch.Tensor), torch.full((4,), 3.0))
        assert ran == ["longrun-compile"], "the training thread ran the region as written"
        assert background.take_over() is None, "nothing to take over while the thread compiles"
        release.set()
        background.thread.join(30)
        line = background.take_over()
        assert line is not None and "compiled in the background in" in line
        assert background.take_over() is None, "said once"
        region.on_cuda(x)
        assert ran == ["longrun-compile", "MainThread"] and traced == ["longrun-compile"]
    finally:
        release.set()
        background.close()
    assert compiled_module.compiling(), "after a run the training thread compiles inline again"


def test_a_rehearsal_that_fails_hands_the_compile_back_to_the_training_thread(monkeypatch):
    from trainer.compiled import BackgroundCompile

    monkeypatch.setattr(compiled_module, "ENABLED", True)

    def rehearse():
        raise RuntimeError("no Triton here")

    background = BackgroundCompile(rehearse)
    try:
        background.thread.join(30)
        assert not compiled_module.compiling()
        line = background.take_over()
        assert "failed" in line and "RuntimeError: no Triton here" in line and "the training thread compiles" in line
        assert compiled_module.compiling()
    finally:
        background.close()


def test_a_rehearsal_reads_the_trained_weights_and_leaves_them_and_their_gradients_alone():
    """The rehearsal's objective shares the draft's storage (no device memory), trains nothing and records nothing on
    the draft's own parameters, on full rows and on packed ones."""
    from tests.trainer.test_training_options import HIDDEN, TTT_STEPS, VOCAB, tiny_draft_and_head
    from trainer.step import rehearsal, rehearsal_lengths, shadow, shortened
    from trainer.ttt import TTTObjective

    draft, head = tiny_draft_and_head()
    objective = TTTObjective(draft, TTT_STEPS, 0.8)
    copy = shadow(objective)
    for mine, theirs in zip(objective.parameters(), copy.parameters(), strict=True):
        assert mine is not theirs and mine.data_ptr() == theirs.data_ptr() and mine.requires_grad == theirs.requires_grad
    assert copy.draft.embed_weight is draft.embed_weight

    g = torch.Generator().manual_seed(0)
    b, s = 2, 300
    batch = {"hidden_states": torch.randn(b, s, 3 * HIDDEN, generator=g),
             "last_hidden_state": torch.randn(b, s, HIDDEN, generator=g),
             "input_ids": torch.randint(0, VOCAB, (b, s), generator=g),
             "loss_mask": torch.ones(b, s, dtype=torch.uint8),
             "position_ids": torch.stack([torch.cat([torch.arange(200), torch.arange(100)]), torch.arange(300)]),
             "documents": ((200, 100), (300,)),
             "trained_rows": torch.arange(5), "trained_counts": [5]}
    batch["loss_mask"][:, :30] = 0
    assert rehearsal_lengths(batch) == [256, 208]
    cut = shortened(batch, 208)
    assert cut["documents"] == ((200, 8), (208,)) and cut["position_ids"].shape == (2, 208)
    assert "trained_rows" not in cut and torch.equal(cut["input_ids"], batch["input_ids"][:, :208])
    late = dict(batch, loss_mask=torch.zeros(b, s, dtype=torch.uint8))
    late["loss_mask"][1, 250:] = 1
    assert rehearsal_lengths(late) == [300, 282], "the cut reaches past where the loss starts"

    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    for packed in (False, True):
        rows = batch if packed else {k: v for k, v in batch.items() if k not in ("position_ids", "documents")}
        rehearsal(objective, head, rows)()
    for name, p in draft.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p, before[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_a_background_rehearsal_compiles_what_the_training_thread_then_runs_on_cuda(monkeypatch, packed):
    """On a GPU, the way the trainer starts: steps run eagerly while BackgroundCompile rehearses; once taken over,
    steps at the rehearsed length and at others compile no graph on the training thread, and train as the eager
    step does."""
    from torch._dynamo.utils import counters

    from tests.trainer.test_training_options import HIDDEN, TTT_STEPS, VOCAB, tiny_draft_and_head
    from trainer.compiled import BackgroundCompile
    from trainer.step import rehearsal
    from trainer.ttt import TTTObjective, batch_targets

    monkeypatch.setattr(compiled_module, "ENABLED", True)
    torch._dynamo.reset()
    draft, head = tiny_draft_and_head()
    draft, head = draft.cuda(), head.to("cuda", torch.bfloat16)
    objective = TTTObjective(draft, TTT_STEPS, 0.8)
    g = torch.Generator().manual_seed(1)

    def batch(s: int) -> dict:
        out = {"hidden_states": torch.randn(2, s, 3 * HIDDEN, generator=g).bfloat16(),
               "last_hidden_state": torch.randn(2, s, HIDDEN, generator=g).bfloat16(),
               "input_ids": torch.randint(0, VOCAB, (2, s), generator=g),
               "loss_mask": (torch.arange(s) >= 20).to(torch.uint8).expand(2, s).clone()}
        if packed:
            out["position_ids"] = torch.stack([torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]), torch.arange(s)])
            out["documents"] = ((s // 2, s - s // 2), (s,))
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    def step(b: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = objective(b["hidden_states"], b["input_ids"], batch_targets(head, b), b.get("position_ids"),
                                b.get("documents"))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in draft.parameters() if p.grad is not None]

    first, other = batch(600), batch(440)
    background = BackgroundCompile(rehearsal(objective, head, first))
    try:
        eager = step(first)  # while the thread compiles
        while not background.done.wait(0.05):
            step(first)
        line = background.take_over()
        assert line is not None and "compiled in the background" in line, line
        graphs, aot = counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
        assert graphs > 0
        compiled_first = step(first)
        step(other)
        assert (counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]) == (graphs, aot), \
            "the training thread compiled a graph the rehearsal had not"
    finally:
        background.close()
    torch.testing.assert_close(compiled_first[0], eager[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(compiled_first[1], eager[1], strict=True):
        assert torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.995


STOPPED_MID_COMPILE = textwrap.dedent("""
    import sys, time
    from trainer.compiled import BackgroundCompile
    background = BackgroundCompile(lambda: time.sleep(300))  # a compile that outlasts the stop
    time.sleep(0.2)
    print(time.monotonic(), flush=True)  # the stop: what follows is the exit alone, not the imports before it
    background.close()
    sys.exit(143)
""")


@pytest.mark.slow  # a process that imports torch
def test_a_run_stopped_while_its_compile_runs_exits_at_once_with_its_own_code():
    """A stop (SIGTERM, a restart's) ends the trainer within the supervisor's grace however long the background
    compile has left: close() does not wait for it, and the process exits with the code the run chose. Timed from
    the stop to the exit (CLOCK_MONOTONIC is the machine's, the same in both processes): a loaded machine's slow
    torch import before the stop is no part of it."""
    import time

    done = subprocess.run([sys.executable, "-c", STOPPED_MID_COMPILE], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=240)
    exited = time.monotonic()
    assert done.returncode == 143, done.stderr[-2000:]
    assert exited - float(done.stdout.split()[-1]) < 10, "the exit waited for the compile (300 s)"
