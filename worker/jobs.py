"""What a run's spec becomes on a host: the torchrun command line and its environment."""

from typing import Any

RDZV_PORT = 29400


def trainer_flags(trainer: dict[str, Any]) -> list[str]:
    """The trainer spec as `python -m trainer.train` flags, in the spec's order."""
    flags: list[str] = []
    for key, value in trainer.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def job_argv(spec: dict[str, Any], python: str, run_id: str, node_rank: int = 0,
             master_addr: str | None = None) -> list[str]:
    """torchrun for one node of the run: standalone on one host, c10d rendezvous on the first host otherwise."""
    nnodes = len(spec.get("hosts") or [spec.get("host")])
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={spec['nproc_per_node']}"]
    if nnodes == 1:
        # --standalone picks a free rendezvous port, so several runs can share a host
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={master_addr}:{RDZV_PORT}", f"--rdzv-id={run_id}"]
    if spec.get("trainer"):
        return argv + ["-m", "trainer.train"] + trainer_flags(spec["trainer"])
    return argv + [spec["entrypoint"]] + [str(a) for a in spec.get("args", [])]
