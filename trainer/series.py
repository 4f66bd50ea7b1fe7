"""The series the bundled trainer writes on its metrics lines, named here once.

Each training line (one per optimizer step) carries `step`, `total_steps`, `epoch`, `loss` (Σ_k w^k loss_k over
the TTT steps), `lr`, `grad_norm`, `tokens_per_s`, `ttt_steps` and, per TTT step k = 0..T-1, `loss_k`, `acc_k`
(the draft's top-1 equals the verifier's) and `cond_acc_k` (the same given steps 0..k-1 were right). Each
validation line carries `val_loss` and the per-step ones with `val_` before them (`val_loss_k`, `val_acc_k`,
`val_cond_acc_k`), and with --sim-depth D the simulated chain drafting's `sim_acc_k`, `sim_tau_d`,
`sim_step_acc_k`, `sim_rounds_k` and `sim_scored_k` for k, d = 1..D (trainer/simulate.py). With --eval-corpus
the last line carries `eval_accepted_d` by depth d.

Each training line also says whether the disk keeps up (trainer/metrics.py `InputWait`): `data_wait_s`, the seconds
the step waited for its batch (on a GPU, the part of that wait the GPU spent idle), `step_time_s`, the step's time
from the previous step's end to its own, and `input_bound`, the share of the last ten steps' time spent waiting
(0: the loader is always ahead; 0.3: the GPU idles 30 % of the time for want of data).

Standard library only, and the trainer package's `__init__` imports nothing: the service's readers (the depth
proposal, the ingest, the command's views) import this module without loading torch, and the page reads the
same names from server/web/names.js (`TRAINER_SERIES`: `python -m trainer.series` prints it; pinned to `NAMES`
by tests/test_shared_names.py).
"""

import json
import re

STEP, TOTAL_STEPS, EPOCH = "step", "total_steps", "epoch"
LOSS = "loss"  # also the base of loss_k
LR, GRAD_NORM, TOKENS_PER_S, TTT_STEPS = "lr", "grad_norm", "tokens_per_s", "ttt_steps"
ACC, COND_ACC = "acc", "cond_acc"  # acc_k, cond_acc_k for TTT step k = 0..T-1
VAL = "val_"  # before a validation's loss, loss_k, acc_k and cond_acc_k
VAL_LOSS, VAL_ACC = VAL + LOSS, VAL + ACC
SIM_ACC, SIM_TAU = "sim_acc", "sim_tau"  # sim_acc_k, sim_tau_d for k, d = 1..--sim-depth
# sim_step_acc_k: proposal k right over every round (no survivor bias); sim_rounds_k, sim_scored_k: the rounds behind
# sim_acc_k and sim_step_acc_k (trainer/simulate.py)
SIM_STEP_ACC, SIM_ROUNDS, SIM_SCORED = "sim_step_acc", "sim_rounds", "sim_scored"
EVAL_ACCEPTED = "eval_accepted"  # eval_accepted_d by depth d
DATA_WAIT_S, STEP_TIME_S, INPUT_BOUND = "data_wait_s", "step_time_s", "input_bound"  # the wait for data (see above)
# from this share of a step spent waiting for data on, the run's answer says the reads are the bound
INPUT_BOUND_NOTICE = 0.1

# what the page reads (server/web/names.js TRAINER_SERIES)
NAMES = {"loss": LOSS, "acc": ACC, "cond_acc": COND_ACC, "val": VAL, "sim_acc": SIM_ACC, "sim_tau": SIM_TAU,
         "tokens_per_s": TOKENS_PER_S, "eval_accepted": EVAL_ACCEPTED, "ttt_steps": TTT_STEPS}


def indexed(base: str, k: int) -> str:
    """The series of `base` at step, position or depth k: indexed(ACC, 2) is "acc_2"."""
    return f"{base}_{k}"


def indexed_pattern(base: str) -> re.Pattern[str]:
    """`base`_k for any k, k as the first group: indexed_pattern(SIM_ACC).match("sim_acc_3")[1] == "3"."""
    return re.compile(rf"^{re.escape(base)}_(\d+)$")


def page_constant() -> str:
    """server/web/names.js's line that gives the page these names."""
    return f"export const TRAINER_SERIES = {json.dumps(NAMES)};"


if __name__ == "__main__":
    print(page_constant())
