"""The host agent's protocol is bytes: its request is read from stdin's buffer and decoded as UTF-8 by the agent,
its answer written as ASCII bytes, so a host's locale, LANG, PYTHONIOENCODING or PYTHONUTF8 cannot change what it
reads or writes (a text-mode stdin under a strict UTF-8 locale failed on the zipapp's bytes after the request)."""

import ast
import io
import json
from pathlib import Path

import pytest

from worker.host_agent import AGENT_FLAGS, HOSTSIDE_ZIPAPP
from worker.hostside import agent

HOSTSIDE = Path(agent.__file__).parent


def _text_stdio_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("print", "input"):
            found.append(f"line {node.lineno}: {node.func.id}()")
        if (isinstance(node, ast.Attribute) and node.attr in ("stdin", "stdout", "stderr")
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            found.append(f"line {node.lineno}: sys.{node.attr}")
    return found


def test_nothing_in_the_agent_reads_or_writes_text_mode_stdio() -> None:
    """Every use of sys.stdin/stdout/stderr in worker/hostside is `sys.X.buffer`, and nothing prints."""
    offenders = []
    for path in sorted(HOSTSIDE.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        buffered = {node.value.lineno for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr == "buffer"
                    and isinstance(node.value, ast.Attribute) and node.value.attr in ("stdin", "stdout")}
        offenders += [f"{path.name} {use}" for use in _text_stdio_uses(tree)
                      if int(use.split()[1].rstrip(":")) not in buffered]
    assert offenders == [], offenders


def test_the_request_is_read_as_bytes_up_to_its_line_and_the_zipapp_after_it_is_left_alone() -> None:
    request = {"dir": "/w/ś pace/☃", "token": "t"}
    stream = io.BytesIO(json.dumps(request, ensure_ascii=False).encode("utf-8") + b"\n" + HOSTSIDE_ZIPAPP)
    assert agent.read_request(stream) == request
    assert stream.read() == HOSTSIDE_ZIPAPP


@pytest.mark.parametrize(("line", "says"), [
    (b"\xff\xfe{}\n", "not UTF-8"),
    (b"[1, 2]\n", "JSON list, not an object"),
    (b"{oops\n", "not JSON"),
    (b"", "not JSON"),
])
def test_a_request_that_is_not_a_utf8_json_object_is_refused_saying_what_it_was(line: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        agent.read_request(io.BytesIO(line))


def test_the_answer_is_one_line_of_ascii_bytes_whatever_it_holds() -> None:
    out = io.BytesIO()
    agent.answer({"log": "héllo ☃ \udcff"}, out)
    raw = out.getvalue()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and raw.isascii()
    assert json.loads(raw)["log"] == "héllo ☃ \udcff"


def test_the_host_runs_the_agent_in_utf8_mode_without_site_hooks() -> None:
    assert AGENT_FLAGS == ("-S", "-X", "utf8")
