// The names the page shares with the server: a run's states (server/lifecycle.py) and the GPU series the worker
// stores (server/series.py). The page cannot import them; tests/test_shared_names.py fails when these drift.

export const RUN_STATES = ["queued", "launching", "running", "cancelling", "restarting", "succeeded", "failed", "cancelled"];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const GPU_UTIL_SERIES = /^(node\d+_)?gpu_util_\d+$/;
export const GPU_MEM_SERIES = /^(node\d+_)?gpu_mem_\d+$/;
