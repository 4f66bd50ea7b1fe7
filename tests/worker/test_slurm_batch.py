"""The batch script a Slurm attempt is submitted with: each spec value reaches sbatch and the program literally,
and torchrun gets its rendezvous on every node. A multi-node allocation cannot exist on this one machine, so the
scripts run under bash with stand-ins for `srun` (it starts the command once per node, as srun does) and
`scontrol`; the single-node path runs under a real Slurm in test_slurm_service.py."""

import json
import os
import stat
import subprocess
from pathlib import Path

from server.spec import RunCreate
from worker.protocol import QueueState
from worker.slurm import batch_script, queue_message

NASTY = "a b; touch /tmp/longrun-pwned $(id) `id` \"q\" 'q' \\ *"


def _executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _run_on_nodes(script: str, tmp_path: Path) -> list[dict]:
    """Run the batch script with a stand-in srun that starts its command on nodes 0..N-1 (gpu-a, gpu-b); each start
    of python records its node id, rendezvous host, gloo interface and argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", """#!/bin/bash
nodes=1
while [ "${1#-}" != "$1" ]; do case "$1" in --nodes=*) nodes=${1#--nodes=};; esac; shift; done
names=(gpu-a gpu-b)
for i in $(seq 0 $((nodes - 1))); do SLURM_NODEID=$i SLURMD_NODENAME=${names[$i]} "$@" || exit $?; done
""")
    # gpu-a is reached at an address this machine holds (loopback), gpu-b at one it does not
    _executable(bin_dir / "scontrol", """#!/bin/bash
case "$2" in
hostnames) printf 'gpu-a\\ngpu-b\\n';;
node) [ "$4" = gpu-a ] && addr=127.0.0.1 || addr=10.213.254.2; echo "NodeName=$4 Arch=x86_64 NodeAddr=$addr";;
esac
""")
    record = tmp_path / "starts.jsonl"
    _executable(tmp_path / "python", f"""#!/usr/bin/env python3
import json, os, sys
with open({str(record)!r}, "a") as f:
    f.write(json.dumps({{"node": os.environ.get("SLURM_NODEID"), "host": os.environ.get("LONGRUN_RDZV_HOST"),
                        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "argv": sys.argv[1:]}}) + "\\n")
""")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "gpu-[a-b]"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    done = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_a_one_node_script_runs_torchrun_standalone_with_the_args_literally(tmp_path: Path) -> None:
    spec = RunCreate(host="login", nproc_per_node=2, entrypoint="/opt/my train.py", args=[NASTY, "--lr", "0.1"],
                     slurm={"partition": "gpu", "time_limit": "1-00:00:00", "gpus_per_node": "h100:2",
                            "sbatch_options": ["--comment=" + NASTY.replace("'", ""), "--exclusive"]})
    script = batch_script(spec, str(tmp_path / "python"))
    headers = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert headers[:6] == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                           "#SBATCH --time=1-00:00:00", "#SBATCH --gpus-per-node=h100:2",
                           "#SBATCH --comment='a b; touch /tmp/longrun-pwned $(id) `id` \"q\" q \\ *'"]
    assert headers[6:] == ["#SBATCH --exclusive"]
    starts = _run_on_nodes(script, tmp_path)
    assert starts == [{"node": "0", "host": None, "gloo": None, "argv": [
        "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "/opt/my train.py", NASTY, "--lr", "0.1"]}]
    assert not Path("/tmp/longrun-pwned").exists()


def test_a_two_node_script_runs_torchrun_on_each_node_with_the_first_serving_the_rendezvous(tmp_path: Path) -> None:
    spec = RunCreate(host="login", nproc_per_node=4, slurm={"nodes": 2},
                     trainer={"verifier_path": "/m", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o x",
                              "ttt_steps": 5})
    starts = _run_on_nodes(batch_script(spec, str(tmp_path / "python")), tmp_path)
    program = ["-m", "trainer.train", "--verifier-path", "/m", "--data-dir", "/d", "--vocab-mapping-dir", "/v",
               "--output-dir", "/o x", "--ttt-steps", "5"]
    # each node goes by its NodeAddr; gloo is bound to the interface that holds it, where the node has one
    addresses = ["127.0.0.1", "10.213.254.2"]
    assert starts == [{"node": str(i), "host": "127.0.0.1", "gloo": ["lo", None][i], "argv": [
        "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=2", f"--node-rank={i}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=42", f"--rdzv-conf=is_host={int(i == 0)}",
        f"--local-addr={addresses[i]}", *program]} for i in (0, 1)]


def test_the_pending_message_names_slurms_reason_and_the_expected_start() -> None:
    queued = QueueState("17", "PENDING", "Priority", 1796092800.0)
    assert queue_message(queued) == ("pending in Slurm as job 17: Priority; expected to start at "
                                     "2026-12-01 02:40:00 UTC")
    assert queue_message(QueueState("18", "PENDING")) == "pending in Slurm as job 18: PENDING"
