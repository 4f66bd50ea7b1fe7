"""The README's story on this machine, verbatim, on what the demo prepared: `examples/demo.py --quick` (what
`make demo-quick` runs) first, in this clone, as a new user runs it; then the README's `readme-story` command block
run by bash, line by line as a user pastes it, in the clone, on a fresh LONGRUN_HOME. The block reads the verifier
and the data the demo left (`.demo/verifier`, `.demo/data`, through examples/local-ttt3.yaml): a demo that leaves
them elsewhere, or a README step that breaks, fails this test."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sshd import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / ".demo"


def story_block() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- readme-story -->\n```bash\n(.*?)```", readme, re.S)
    assert found, "the README has no block marked <!-- readme-story -->"
    return found.group(1)


def run_logged(argv: list[str], env: dict[str, str], log: Path, timeout: int) -> int:
    """Run `argv` in the clone, its output to `log` (a server the block starts in the background keeps a pipe open
    after bash ends), and kill its process group after it (the server, if a line failed before `kill $server`)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{argv[-1][:60]!r} did not finish in {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode


def test_the_readme_story_runs_as_written_after_the_quick_demo(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("LONGRUN_API_TOKEN", "LONGRUN_POLL_INTERVAL", "LONGRUN_URL", "LONGRUN_HOME"):
        env.pop(name, None)  # the demo and the server a user starts: no token, their own tick and home
    demo_log = tmp_path / "demo.log"
    # the two within pytest-timeout's 900 s, each failing with its own output when it runs out
    rc = run_logged([sys.executable, "examples/demo.py", "--quick"], env, demo_log, 540)
    assert rc == 0, demo_log.read_text(errors="replace")[-4000:]
    assert (DEMO / "verifier" / "config.json").is_file(), "the quick demo left no verifier at .demo/verifier"
    assert any((DEMO / "data" / "hidden_states").iterdir()), "the quick demo left no data at .demo/data"

    home, port = tmp_path / "home", free_port()
    env = {**env, "LONGRUN_HOME": str(home), "LONGRUN_PORT": str(port), "LONGRUN_URL": f"http://127.0.0.1:{port}"}
    log = tmp_path / "story.log"
    rc = run_logged(["bash", "-c", "set -e\n" + story_block()], env, log, 300)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    workspace = home / "workspace"
    assert f"trainer.output_dir: local-ttt3 -> {workspace / 'local-ttt3'}" in text, text[-3000:]
    assert f"trainer.verifier_path: ../.demo/verifier -> {DEMO / 'verifier'}" in text
    assert "ttt_steps: 3 -> 5" in text and "start: fresh" in text, "the dry run said what the restart would do"
    assert (workspace / "local-ttt3" / "model.safetensors").is_file(), "the TTT=5 attempt exported its draft"
    status = text[text.rindex("local-ttt3 ["):]  # `longrun status local-ttt3`, the block's last output
    assert re.search(r"succeeded\s+attempt 2\s.*TTT 5", status), status[-2000:]
    assert re.search(r"acc_k\s+0 \S+\s+1 \S+\s+2 \S+\s+3 \S+\s+4 ", status), "five positions at TTT=5"
