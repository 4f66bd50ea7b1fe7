"""`compiled`: eager wherever compiling does not apply, and eager again when the host cannot compile."""

import pytest
import torch

from trainer import compiled as compiled_module
from trainer.compiled import compiled


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
