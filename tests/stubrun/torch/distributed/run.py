"""A stdlib torchrun for single-node test jobs: what longrun relies on of torch 2.13's launcher.

Followed: torch/distributed/run.py (its flags), elastic/multiprocessing/api.py and subprocess_handler.py (each
worker in a session of its own, `python -u SCRIPT` or `python -u -m MODULE`; on SIGTERM/SIGINT/SIGHUP/SIGQUIT the
signal goes to every worker's process group, 30 s of grace, then SIGKILL), elastic/agent/server/api.py (the worker
environment; with --max-restarts 0, the first failed worker stops the rest and the launcher exits 1) and
elastic/multiprocessing/errors/__init__.py (the failure summary, and the root cause's error file copied to the
launcher's own TORCHELASTIC_ERROR_FILE). Workers start with this folder off PYTHONPATH, so a worker that imports
torch gets the real one. Several nodes (--nnodes > 1) need the real rendezvous: that command line
is handed to the real torchrun.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

STUB_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRACE_S = 30
VALUED = {"nproc-per-node", "nnodes", "node-rank", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
          "local-addr", "max-restarts", "monitor-interval", "role", "master-addr", "master-port", "log-dir",
          "redirects", "tee", "start-method", "rdzv-timeout", "local-ranks-filter"}


def parse(argv):
    """(options, module?, program, its args): options up to the first argument that is not one."""
    opts, module, i = {}, False, 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i].lstrip("-")
        key, eq, value = arg.partition("=")
        key = key.replace("_", "-")
        if key in ("m", "module"):
            module = True
        elif key in VALUED and not eq:
            i += 1
            value = argv[i]
        opts[key] = value if (eq or key in VALUED) else True
        i += 1
    if i >= len(argv):
        sys.exit("usage: python -m torch.distributed.run [options] SCRIPT [args...]")
    return opts, module, argv[i], argv[i + 1:]


def without_stub():
    """The environment with this stand-in off PYTHONPATH: a worker that imports torch gets the real one."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != STUB_ROOT]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": os.pathsep.join(path)} if path else env


def real_torchrun(argv):
    """The real launcher with the same command line."""
    os.execve(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv], without_stub())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(script, failure, error_file):
    width = 60
    return "\n".join([
        "", "=" * width, f"{script} FAILED", "-" * width, "Failures:", "  <NO_OTHER_FAILURES>", "-" * width,
        "Root Cause (first observed failure):", "[0]:",
        f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S')}", f"  host      : {socket.getfqdn()}",
        f"  rank      : {failure['rank']} (local_rank: {failure['rank']})",
        f"  exitcode  : {failure['code']} (pid: {failure['pid']})",
        f"  error_file: {error_file if os.path.isfile(error_file) else '<N/A>'}",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html", "=" * width])


def main(argv):
    opts, module, script, args = parse(argv)
    if int(opts.get("nnodes", "1").split(":")[-1]) > 1:
        real_torchrun(argv)
    nproc = int(opts.get("nproc-per-node", "1"))
    run_dir = tempfile.mkdtemp(prefix="torchelastic_stub_")
    base = {**without_stub(), "MASTER_ADDR": opts.get("master-addr", "127.0.0.1"),
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": opts.get("rdzv-id", "none"), "TORCHELASTIC_USE_AGENT_STORE": "False"}
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-u", *(["-m"] if module else []), script, *args]
    workers, error_files = [], []
    for rank in range(nproc):
        error_files.append(os.path.join(run_dir, str(rank), "error.json"))
        os.makedirs(os.path.dirname(error_files[-1]))
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
               "TORCHELASTIC_ERROR_FILE": error_files[-1]}
        workers.append(subprocess.Popen(command, env=env, start_new_session=True))
    received = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, lambda signum, _frame: received.append(signum))

    def signal_live(sig):
        for w in workers:
            if w.poll() is None:
                try:
                    os.killpg(w.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(sig):
        signal_live(sig)
        deadline = time.monotonic() + GRACE_S
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_live(signal.SIGKILL)
        for w in workers:
            w.wait()

    while True:
        if received:
            stop(received[0])
            return 128 + received[0]
        codes = [w.poll() for w in workers]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            stop(signal.SIGTERM)
            parent_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
            if parent_file and os.path.isfile(error_files[rank]):
                with open(error_files[rank]) as f:
                    body = json.load(f)
                with open(parent_file, "w") as f:
                    json.dump(body, f)
            print(summary(script, {"rank": rank, "code": code, "pid": workers[rank].pid}, error_files[rank]),
                  file=sys.stderr, flush=True)
            return 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
