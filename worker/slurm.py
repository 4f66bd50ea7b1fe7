"""A run's attempt as a Slurm batch job (hosts of kind `slurm`): the batch script the worker sends, and what the
run says while the job waits in the queue. worker/hostside/slurm.py submits, probes and cancels it on the login node.

The script asks for `slurm.nodes` nodes with one task each and runs torchrun on every one of them through `srun`:
standalone on one node, a c10d rendezvous served by the first node otherwise. Every value from the run spec goes
through shlex.quote; the environment (the attempt token among it) reaches the job from sbatch's own, never
through the script.
"""

import shlex
from datetime import UTC, datetime

from server.spec import RunCreate, SlurmSpec
from worker.jobs import RDZV_PORT, program_argv
from worker.protocol import QueueState, SlurmBatch

# run-spec field -> sbatch option
SBATCH_FIELDS = (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time"),
                 ("gpus_per_node", "--gpus-per-node"))


def sbatch_line(option: str) -> str:
    """`--name` or `--name=value` as an #SBATCH line, the value shell-quoted (sbatch reads quotes back)."""
    name, eq, value = option.partition("=")
    return f"#SBATCH {name}" + (f"={shlex.quote(value)}" if eq else "")


def batch_script(spec: RunCreate, python: str) -> str:
    """The batch script of one attempt of `spec` (its `slurm`, server/spec.py SlurmSpec)."""
    slurm = spec.slurm or SlurmSpec()
    nodes = slurm.nodes
    options = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    options += [f"{flag}={getattr(slurm, key)}" for key, flag in SBATCH_FIELDS if getattr(slurm, key) is not None]
    options += slurm.sbatch_options
    torchrun = shlex.join([python, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}"])
    program = shlex.join(program_argv(spec))
    # srun does not pass --cpus-per-task on from sbatch in every Slurm version: torchrun's processes need them
    step = f'srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task="${{SLURM_CPUS_PER_TASK:-1}}" --kill-on-bad-exit=1'
    lines = ["#!/bin/bash", *(sbatch_line(o) for o in options), ""]
    if nodes == 1:
        lines.append(f"exec {step} {torchrun} --standalone {program}")
    else:
        # each node's rank and address are known only on the nodes: bash expands them there. Addresses are the
        # nodes' NodeAddr (what Slurm itself reaches them at): node names need not resolve across the cluster
        task = ('addr=$(longrun_node_addr "$SLURMD_NODENAME"); '
                'if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then '
                'ifname=$(ip -o -4 addr show to "$addr" 2>/dev/null | awk "{print \\$2; exit}"); '
                'if [ -n "$ifname" ]; then export GLOO_SOCKET_IFNAME=$ifname; fi; fi; '
                f'exec {torchrun} --nnodes={nodes} --node-rank="$SLURM_NODEID" --rdzv-backend=c10d '
                f'--rdzv-endpoint="$LONGRUN_RDZV_HOST:{RDZV_PORT}" --rdzv-id="$SLURM_JOB_ID" '
                f'--rdzv-conf=is_host=$(( SLURM_NODEID == 0 )) --local-addr="$addr" {program}')
        lines += ["longrun_node_addr() {",
                  '    addr=$(scontrol show node --oneliner "$1" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
                  '    echo "${addr:-$1}"',
                  "}",
                  "export -f longrun_node_addr",
                  'LONGRUN_RDZV_HOST=$(longrun_node_addr "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)")',
                  "export LONGRUN_RDZV_HOST",
                  f"exec {step} bash -c {shlex.quote(task)}"]
    return "\n".join(lines) + "\n"


def slurm_batch(spec: RunCreate, python: str, run_id: str, attempt: int) -> SlurmBatch:
    return SlurmBatch(batch_script(spec, python), f"longrun-{run_id}-{attempt}")


def queue_message(queue: QueueState) -> str:
    """The run's message while its job waits: Slurm's reason, and when Slurm expects it to start."""
    why = queue.reason or queue.state
    start = ""
    if queue.expected_start is not None:
        start = f"; expected to start at {datetime.fromtimestamp(queue.expected_start, UTC):%Y-%m-%d %H:%M:%S} UTC"
    return f"pending in Slurm as job {queue.job_id}: {why}{start}"
