"""Where longrun keeps its records on a host, defined once for the server and the worker:

    <workspace>/.longrun/bin/                      the host agent (hostside-<sha>/: worker/hostside/, unpacked)
    <workspace>/.longrun/<run_id>/<attempt>/       one attempt (node 0; node i in node<i>/)
    <workspace>/.longrun/<run_id>/draft-before-attempt-<n>/   a draft kept aside by a clean restart
    <workspace>/.longrun/<run_id>/tracking/        the trainer's one tracker run for all attempts (trainer/trackers.py)

The host agent (worker/hostside/files.py) names the files inside an attempt directory itself (it runs alone on the host);
tests/worker/test_protocol.py holds the two in step.
"""

import posixpath
from dataclasses import dataclass

RECORDS_DIR = ".longrun"
LOG_FILE = "output.log"
METRICS_FILE = "metrics.jsonl"

# where a workspace must not lead, once its symlinks are followed: longrun writes and cleans under it
SYSTEM_DIRECTORIES = frozenset({"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt",
                                "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var"})


# how a host's error begins when its python cannot run the agent (worker/host_agent.py PythonUnfit): registration
# and a change of the host refuse that python, naming body.python
PYTHON_UNFIT = "python: "


# kernel file systems: their paths name processes, devices and kernel settings, not directories longrun may fill
# (/proc/self/cwd is the directory of whichever process reads it: the server's own, or the host agent's)
KERNEL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")


def kernel_file_system(path: str) -> str | None:
    """The kernel file system (/proc, /sys, /dev) that the normalised absolute `path` lies in, or None."""
    return next((top for top in KERNEL_FILE_SYSTEMS if path == top or path.startswith(top + "/")), None)


def workspace_refusal(workspace: str, real: str) -> str | None:
    """Why a workspace whose real path (its symlinks followed on its host) is `real` is refused, or None."""
    if (top := kernel_file_system(real)) is not None:
        return (f"workspace {workspace!r} leads to {real}, under {top}, a kernel file system whose paths name "
                "processes and devices: give a directory of longrun's own, e.g. /srv/longrun")
    if real not in SYSTEM_DIRECTORIES:
        return None
    return (f"workspace {workspace!r} leads to {real} (its symlinks followed on the host): give a directory of "
            "longrun's own, e.g. /srv/longrun")


@dataclass(frozen=True)
class HostLayout:
    workspace: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "workspace", self.workspace.rstrip("/") or "/")

    @property
    def records(self) -> str:
        return posixpath.join(self.workspace, RECORDS_DIR)

    @property
    def bin_dir(self) -> str:
        return posixpath.join(self.records, "bin")

    def run_dir(self, run_id: str) -> str:
        return posixpath.join(self.records, run_id)

    def attempt_dir(self, run_id: str, attempt: int, node: int = 0) -> str:
        base = posixpath.join(self.run_dir(run_id), str(attempt))
        return base if node == 0 else posixpath.join(base, f"node{node}")

    def draft_stash(self, run_id: str, attempt: int) -> str:
        """Where a clean restart into `attempt` keeps the previous draft while the output directory is emptied."""
        return posixpath.join(self.run_dir(run_id), f"draft-before-attempt-{attempt}")

    def holds_records_of(self, path: str, run_id: str) -> bool:
        return path.startswith(self.run_dir(run_id) + "/")


def log_path(attempt_dir: str) -> str:
    return posixpath.join(attempt_dir, LOG_FILE)
