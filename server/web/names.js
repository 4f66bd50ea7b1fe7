// The names the page shares with the server: a run's states (server/lifecycle.py), the GPU series the worker
// stores (server/series.py) and the bundled trainer's series (trainer/series.py). The page cannot import them;
// tests/test_shared_names.py fails when these drift.

export const RUN_STATES = ["queued", "launching", "running", "cancelling", "restarting", "succeeded", "failed", "cancelled"];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const GPU_UTIL_SERIES = /^(node\d+_)?gpu_util_\d+$/;
export const GPU_MEM_SERIES = /^(node\d+_)?gpu_mem_\d+$/;
// trainer/series.py NAMES, as `python -m trainer.series` prints them
export const TRAINER_SERIES = {"loss": "loss", "acc": "acc", "cond_acc": "cond_acc", "val": "val_", "sim_acc": "sim_acc", "sim_tau": "sim_tau", "tokens_per_s": "tokens_per_s", "eval_accepted": "eval_accepted", "ttt_steps": "ttt_steps"};
// a series of `base` at step, position or depth k (`acc_2`), and a test for any k with k as its first group
export const indexed = (base, k) => `${base}_${k}`;
export const indexedPattern = (base) => new RegExp(`^${base}_(\\d+)$`);
// the server's markers of a non-finite value in a run's latest (worker/metric_values.py): JSON has no NaN
export const NOT_FINITE = new Set(["NaN", "Infinity", "-Infinity"]);
