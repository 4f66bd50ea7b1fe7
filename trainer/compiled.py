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
import warnings
from collections.abc import Callable

import torch

COMPILE_ENV = "LONGRUN_COMPILE"
ENABLED = os.environ.get(COMPILE_ENV, "1") != "0"


def compiled(fn: Callable) -> Callable:
    """`fn`, compiled when its first argument is a CUDA tensor and autograd records (training); `.on_cuda` is
    the variant for callers that know they are training where autograd does not record (an autograd
    Function's own forward and backward)."""
    state = {}

    def on_cuda(*args):
        if not (ENABLED and args[0].is_cuda):
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
