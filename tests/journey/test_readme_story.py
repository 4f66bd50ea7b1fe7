"""The README's story on this machine, verbatim: its `readme-story` command block run by bash, line by line as a
user pastes it, on a fresh LONGRUN_HOME, in a copy of the clone's examples/ beside a .demo/ prepared as `make demo`
prepares it (a tiny verifier here, built locally). A README step that breaks fails this test."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sshd import free_port
from tests.trainer.tiny_setup import build_all

ROOT = Path(__file__).resolve().parents[2]


def story_block() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- readme-story -->\n```bash\n(.*?)```", readme, re.S)
    assert found, "the README has no block marked <!-- readme-story -->"
    return found.group(1)


def test_the_readme_story_runs_as_written(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "examples", clone / "examples")
    build_all(clone / ".demo")
    home, port = tmp_path / "home", free_port()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "LONGRUN_HOME": str(home), "LONGRUN_PORT": str(port), "LONGRUN_URL": f"http://127.0.0.1:{port}",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("LONGRUN_API_TOKEN", "LONGRUN_POLL_INTERVAL"):  # the server a user starts: no token, its own tick
        env.pop(name, None)
    script = "set -e\n" + story_block()
    log = tmp_path / "story.log"
    # the output to a file: the server the block starts in the background keeps a pipe open after bash ends
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the README story did not finish in 600 s:\n{log.read_text(errors='replace')[-4000:]}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the server, if a line failed before `kill $server`
            except ProcessLookupError:
                pass
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    workspace = home / "workspace"
    assert f"trainer.output_dir: local-ttt3 -> {workspace / 'local-ttt3'}" in text, text[-3000:]
    assert f"trainer.verifier_path: ../.demo/verifier -> {clone / '.demo' / 'verifier'}" in text
    assert (workspace / "local-ttt3" / "model.safetensors").is_file(), "the TTT=5 attempt exported its draft"
    status = text[text.rindex("local-ttt3 ["):]  # `longrun status local-ttt3`, the block's last output
    assert re.search(r"succeeded\s+attempt 2\s.*TTT 5", status), status[-2000:]
    assert re.search(r"acc_k\s+0 \S+\s+1 \S+\s+2 \S+\s+3 \S+\s+4 ", status), "five positions at TTT=5"
