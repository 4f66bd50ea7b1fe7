"""torch.compile for the parts of a training step on the GPU that are many small kernels: the two regions of
each TTT step's layer around its attention (`trainer/model.py`: hidden norm, q/k/v and RoPE; o_proj, residual,
norm, SwiGLU MLP, residual), the final norm, and the merge of the TTT attention's diagonal keys.

Eager, these are a hundred or more kernels and host calls per TTT step (casts to float32 and back, the halves of
RoPE, the gate and its product, the residual adds). At 8192 positions their passes over memory took about a
quarter of an 8B-shaped draft's step on an H200; at 2048 positions the host took longer to launch them than the GPU
to run them (the profiles are in the git history of docs/benchmarks.md). Compiled, each region is a few fused
kernels around its matrix products, forward and backward, and one host call. The flash attention stays outside,
as written.

`compiled(fn)` runs `fn` compiled only where it pays and is safe: on CUDA tensors, when the caller says the
call is training (the decode path runs eagerly and under CUDA graphs), and unless `LONGRUN_COMPILE=0`.
Elsewhere, the CPU tests included, `fn` runs as written, so the eager code is the reference the compiled one
is checked against on the GPU. A host whose compiler fails (no C compiler for Triton's launcher, say) warns
once and runs eagerly rather than stopping the run.

`BackgroundCompile` takes the compile off a training run's critical path: a thread of its own compiles every
region (it rehearses a step on shortened copies of a batch), while the training thread runs the regions as written
(from its first step: `defer()`, the trainer starting the thread after its first two steps); at a step boundary once
the thread is done (`take_over`) the training thread switches to the compiled regions. Cold, on a fresh machine, the compile is most of a first step (32-43 s on an
H100, docs/benchmarks.md); this way the run trains, and says so, from the start. Without one the training
thread compiles on its own first call, as `LONGRUN_COMPILE=inline` asks.

`share_dynamic_profile` names the workload for Dynamo's profile-guided dynamism (torch.compiler.config.job_id,
torch/_dynamo/pgo.py): which sizes turned out to vary is kept in the compile cache, so that a later process of
the same draft (the attempt restarted at a deeper TTT, a resumed one, the next run) compiles them dynamic on the
first call, and finds that graph in the inductor cache, instead of compiling a static graph for its first batch's
sizes and recompiling once the next batch differs. Without a job id Dynamo keeps no such profile.
"""

import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

COMPILE_ENV = "LONGRUN_COMPILE"  # 0: never compile; inline: the training thread compiles on its first step
ENABLED = os.environ.get(COMPILE_ENV, "1") != "0"
BACKGROUND = os.environ.get(COMPILE_ENV, "1") != "inline"


class _Mode(threading.local):
    rehearsing = False  # this thread is BackgroundCompile's


_thread = _Mode()
_inline = [True]  # False while a BackgroundCompile runs: other threads run the regions as written


def defer() -> None:
    """From now on every thread but a BackgroundCompile's runs the regions as written, until one takes over: the
    steps before a BackgroundCompile starts run eagerly too, instead of compiling on the training thread."""
    _inline[0] = False


def compiling() -> bool:
    """Whether a region called on this thread now runs compiled (on CUDA, while training)."""
    return ENABLED and (_inline[0] or _thread.rehearsing)


def compiled(fn: Callable) -> Callable:
    """`fn`, compiled when its first argument is a CUDA tensor and autograd records (training); `.on_cuda` is
    the variant for callers that know they are training where autograd does not record (an autograd
    Function's own forward and backward)."""
    state = {}

    def on_cuda(*args, compile: bool | None = None):
        """`compile`: the decision of the thread that recorded the call (an autograd Function's backward runs on
        autograd's device thread: it passes what its forward's thread decided)."""
        if not (args[0].is_cuda and (compiling() if compile is None else compile and ENABLED)):
            return fn(*args)
        if "fn" not in state:
            state["fn"] = torch.compile(fn, dynamic=None)
        try:
            return state["fn"](*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # no working compiler on this host: a run goes on eagerly
            warnings.warn(f"torch.compile of {fn.__name__} failed, it runs eagerly: {type(e).__name__}: {str(e)[:300]}",
                          stacklevel=2)
            state["fn"] = fn
            return fn(*args)

    @functools.wraps(fn)
    def wrapper(*args):
        return on_cuda(*args) if torch.is_grad_enabled() else fn(*args)

    wrapper.on_cuda = on_cuda
    return wrapper


def share_dynamic_profile(draft_config: object) -> str:
    """Sets torch.compiler.config.job_id to one key per draft architecture (every field but the TTT depth, which
    changes how many times each region runs, not its sizes), unless the user set one (TORCH_COMPILE_JOB_ID);
    returns the job id in force."""
    if torch.compiler.config.job_id is None:
        shape = {k: v for k, v in dataclasses.asdict(draft_config).items() if k != "ttt_steps"}
        key = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
        torch.compiler.config.job_id = f"longrun-eagle3-draft-{key}"
    return torch.compiler.config.job_id


class BackgroundCompile:
    """Runs `rehearse()` (a training step's regions on CUDA, its result thrown away) on a thread of its own, which
    compiles them, while every other thread runs them as written; `take_over()` at a step boundary hands the
    compiled regions to the training thread once that thread is done. One at a time, per process."""

    def __init__(self, rehearse: Callable[[], None]):
        self.started = time.monotonic()
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.taken = False
        _inline[0] = False
        self.thread = threading.Thread(target=self._run, args=(rehearse,), name="longrun-compile", daemon=True)
        self.thread.start()

    def _run(self, rehearse: Callable[[], None]) -> None:
        _thread.rehearsing = True
        try:
            rehearse()
        except BaseException as exc:  # the training thread compiles on its own after all
            self.error = exc
        finally:
            _thread.rehearsing = False
            self.seconds = time.monotonic() - self.started
            self.done.set()

    def take_over(self) -> str | None:
        """None while the thread compiles; once it is done, the compiled regions are this thread's from now on,
        and the line that says so (once)."""
        if self.taken or not self.done.is_set():
            return None
        self.taken = True
        _inline[0] = True
        if self.error is not None:
            return (f"torch.compile in the background failed after {self.seconds:.1f} s "
                    f"({type(self.error).__name__}: {str(self.error)[:300]}); the training thread compiles instead")
        return f"torch.compile: compiled in the background in {self.seconds:.1f} s; the compiled regions run from here on"

    def close(self) -> None:
        """At the end of a run: back to compiling inline, without waiting for the thread. A stop must not wait for
        a compile (the supervisor's grace is seconds; the first served run on an H100 that waited here was
        SIGKILLed): the thread is a daemon, and a compile cut short leaves nothing half-written in the caches."""
        _inline[0] = True
