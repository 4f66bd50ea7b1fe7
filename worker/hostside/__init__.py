"""The host-side agent: the only code longrun runs on a host, stdlib only, Python >= 3.8.

worker/host_agent.py ships this package to a host as one zipapp (the package as `hostside/` and its __main__.py at
the top; imports inside are relative), unpacked there once into hostside-<sha>. Each call is one command,
`python3 -S hostside-<sha> VERB`, reading its request as one JSON line on stdin
(never argv: env values and the attempt token must not show in `ps`) and answering one JSON line on
stdout, so every action is a single round trip over the transport and needs no state on the host
beyond the files in the attempt directory the worker names (server/layout.py decides where it is):

    <attempt dir>/      0700, its files 0600 (they hold the token and the job's env)
        token       the attempt token, also in every process's environment (LONGRUN_ATTEMPT_TOKEN)
        job.json    the launch request, read by the wrapper
        pid         the wrapper's pid (= its process group and session id)
        containment JSON: the layer that holds every process of the attempt, written by the wrapper
        exit_code   written by the wrapper when the job ends (from exit_code.reserve when the disk is full)
        started_at, ended_at   the wrapper's clock when it started the job and when the job ended
        output.log  the job's stdout and stderr
        metrics.jsonl

Containment, the best layer the host offers (a job cannot leave the first two; `env -i setsid` leaves
the third):
    systemd-scope  a transient scope (`systemd-run --scope`) where systemd runs: its own cgroup
    cgroup         a cgroup v2 directory of its own under ours, where that is writable (root, delegation)
    session        its own session; swept by session id and by the token in the environment
Every layer also sweeps the token carriers. Cancel kills the cgroup (cgroup.kill) and checks it is empty.

Verbs (agent.py dispatches them): launch and wrap (internal: the detached wrapper) in launch.py, probe and cancel
in attempt.py, clean in clean.py, gpus and interconnect in gpus.py, verifier in verifier.py. Below them: files.py (the attempt's files,
atomic writes, reads from an offset), procfs.py (what /proc says of processes and cgroups), containment.py (the
layers and who belongs to a node), stop.py (stopping a node and verifying it), slurm.py (an attempt as a batch
job). The agent owns every command line it runs (nvidia-smi, sbatch, scontrol, ...): requests carry only data.

An attempt on a Slurm cluster (a launch that carries `slurm`, see slurm.py) is a batch job instead
of a wrapper: its directory holds `slurm_job` (the job id) in place of `pid` and `containment`, Slurm writes
output.log, and probe and cancel ask Slurm about it. The directory tells which, so probe and cancel need nothing
more from the worker.
"""
