"""What a run's spec becomes on a host: the torchrun command line (or the bundled trainer's, for one process)."""

from server.spec import RunCreate, TrainerSpec

RDZV_PORT = 29400


def trainer_flags(trainer: TrainerSpec) -> list[str]:
    """The trainer spec as `python -m trainer.train` flags, in the order of its fields."""
    flags: list[str] = []
    for key, value in trainer.model_dump(exclude_none=True).items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def job_argv(spec: RunCreate, python: str, run_id: str, node_rank: int = 0,
             master_addr: str | None = None, node_addr: str | None = None) -> list[str]:
    """torchrun for one node of the run: standalone on one host, c10d rendezvous on the first host otherwise; the
    bundled trainer's one process on one host, on its own.

    `master_addr` is the first host's address, `node_addr` this node's: the addresses the nodes reach each
    other at (torchrun's own guesses, from the hostname, fail where names do not resolve across hosts)."""
    nnodes = len(spec.host_names)
    if spec.trainer and nnodes == 1 and spec.nproc_per_node == 1:
        # one process of the bundled trainer needs no launcher (as accelerate's `simple_launcher` runs one process
        # without torchrun, src/accelerate/commands/launch.py): the trainer is one process without torchrun's
        # environment (trainer/train.py Distributed), and torchrun's own start-up (its torch import, its agent, its
        # rendezvous) came before every attempt's first step, a restart's too. -u as torchrun runs its workers
        return [python, "-u", *program_argv(spec)]
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}"]
    if nnodes == 1:
        # --standalone picks a free rendezvous port, so several runs can share a host
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={master_addr}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                 # the first host serves the rendezvous store, whether or not its hostname matches the endpoint
                 f"--rdzv-conf=is_host={int(node_rank == 0)}"]
        if node_addr:
            # the address rank 0 publishes as MASTER_ADDR for the workers' process group
            argv.append(f"--local-addr={node_addr}")
    return argv + program_argv(spec)


def program_argv(spec: RunCreate) -> list[str]:
    """What torchrun starts on each of its processes: the bundled trainer with its flags, or the entrypoint."""
    if spec.trainer:
        return ["-m", "trainer.train"] + trainer_flags(spec.trainer)
    return [spec.entrypoint] + [str(a) for a in spec.args]
