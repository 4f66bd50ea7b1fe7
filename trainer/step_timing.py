"""What one TTT iteration of a training step costs, and what the rest of the step costs: the figures the restart
dry run prices a deeper TTT from (server/eta.py step_cost_model), written in each step's metric line as
`ttt_iter_s` and `step_fixed_s` (fixed + T x iteration = the step's time).

An iteration's forward is timed between the ends of consecutive iterations of the chain (TTTObjective.forward
marks each), its backward between the moments consecutive iterations' outputs get their gradient (a hook on each
output hidden state: the backward of iteration k+1 ends where hidden k's gradient is ready). Both are means over
iterations 1..T-1 of every micro-batch's chain; a step with T = 1 has no second iteration to time (no figures).
On a GPU the marks are CUDA events in the compute stream, read once the step's figures are (no sync of their own);
on the CPU, the host's clock (the work runs as it is queued).

Only steps that run as the rest of the attempt will are reported: once the background compile has handed over
(trainer/compiled.py), not the eager warm-up before it, whose steps took 3.5x as long on an H100 (0.123 s against
0.035 s compiled, the Kimi-K2 draft shape) and made a dry run asked minutes into an attempt 5x too long.
"""

import time
from collections.abc import Callable

import torch


class ChainTimer:
    """Marks of one optimizer step's TTT chains (one per micro-batch), read by `figures` once the step is done."""

    def __init__(self, cuda: bool, clock: Callable[[], float] = time.perf_counter):
        self.cuda, self.clock = cuda, clock
        self.chains: list[tuple[dict[int, object], dict[int, object]]] = []

    def _mark(self) -> object:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_chain(self) -> None:
        self.chains.append(({}, {}))

    def forward_done(self, k: int) -> None:
        """Iteration k's forward (its step and its loss) is queued."""
        self.chains[-1][0][k] = self._mark()

    def watch_backward(self, k: int, hidden: torch.Tensor) -> None:
        """Mark when iteration k's output gets its gradient (the backward of the iterations after it is done)."""
        if hidden.requires_grad:
            marks = self.chains[-1][1]
            hidden.register_hook(lambda grad: marks.__setitem__(k, self._mark()))

    def _seconds(self, a: object, b: object) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return float(b) - float(a)  # type: ignore[arg-type]

    def iteration_seconds(self) -> float | None:
        """The mean forward + backward of one TTT iteration, summed over the step's micro-batches; None where a
        chain has fewer than two iterations or its backward was not seen."""
        total = 0.0
        for forward, backward in self.chains:
            n = len(forward)
            if n < 2 or len(backward) < n:
                return None
            total += (self._seconds(forward[0], forward[n - 1]) + self._seconds(backward[n - 1], backward[0])) / (n - 1)
        return total if self.chains else None


def figures(timer: ChainTimer | None, step_time: float | None, ttt_steps: int) -> dict[str, float]:
    """`ttt_iter_s` and `step_fixed_s` for a step line (nothing where not timed)."""
    if timer is None or step_time is None:
        return {}
    iteration = timer.iteration_seconds()
    if iteration is None or iteration <= 0:
        return {}
    return {"ttt_iter_s": round(iteration, 6), "step_fixed_s": round(max(0.0, step_time - ttt_steps * iteration), 6)}
