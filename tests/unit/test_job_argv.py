"""What a launch starts on a host (worker/jobs.py): torchrun for several processes or a program of the user's, and
the bundled trainer's one process on one host on its own, without torchrun's start-up before its first step."""

from server.spec import RunCreate
from worker.jobs import job_argv

TRAINER = {"verifier_path": "/m/verifier", "data_dir": "/m/data", "vocab_mapping_dir": "/m/vocab", "output_dir": "/w/out",
           "ttt_steps": 3}


def _spec(nproc: int, **fields) -> RunCreate:
    return RunCreate.model_validate({"name": "r", "host": "gpu-box", "nproc_per_node": nproc, **fields})


def test_the_bundled_trainers_one_process_starts_without_torchrun_unbuffered_as_torchrun_runs_it() -> None:
    argv = job_argv(_spec(1, trainer=TRAINER), "/opt/py/bin/python3", "run-1")
    assert argv[:4] == ["/opt/py/bin/python3", "-u", "-m", "trainer.train"]
    assert "torch.distributed.run" not in argv
    assert argv[argv.index("--ttt-steps") + 1] == "3" and argv[argv.index("--output-dir") + 1] == "/w/out"


def test_two_processes_of_the_trainer_and_one_of_a_users_program_start_under_torchrun() -> None:
    two = job_argv(_spec(2, trainer=TRAINER), "python3", "run-1")
    assert two[:5] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert two[5:7] == ["-m", "trainer.train"]
    # a program of the user's may read torchrun's environment (RANK, MASTER_PORT …) even as one process
    own = job_argv(_spec(1, entrypoint="/opt/train.py", args=["--lr", "0.1"]), "python3", "run-2")
    assert own == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone", "/opt/train.py",
                   "--lr", "0.1"]


def test_the_trainer_across_two_hosts_starts_under_torchrun_on_each() -> None:
    spec = RunCreate.model_validate({"name": "r", "hosts": ["a", "b"], "nproc_per_node": 1, "trainer": TRAINER})
    argv = job_argv(spec, "python3", "run-3", node_rank=1, master_addr="10.0.0.1", node_addr="10.0.0.2")
    assert argv[:4] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=1"]
    assert "--nnodes=2" in argv and "--node-rank=1" in argv
