"""GET /v1/runs/{id}/logs over a log bigger than an answer: a tail holds the last lines and no more than its bound,
a read from an offset comes in pages that together hold every stored line once, and a giant line is cut with a
marker instead of being sent whole (server/log_reads.py)."""

import json

from server.log_reads import ANSWER_BYTES, LINE_CHARS
from tests.inprocess import App
from worker.ingest import store_log

READ = 4 << 20  # the most one host read stores (worker/hostside/files.py READ_LIMIT)


def chunks(api: App, run_id: str, texts: list[str]) -> int:
    offset = 0
    with api.db.writing() as s:
        for text in texts:
            end = offset + len(text.encode())
            store_log(s, run_id, 1, 0, offset, end, text)
            offset = end
    return offset


def test_a_big_log_is_read_in_bounded_answers_and_a_giant_line_is_cut(api: App) -> None:
    run = api.submit()
    numbered = [f"line {i:06d} é" + "." * 86 + "\n" for i in range(48_000)]  # 100 bytes a line, 4.6 MiB
    per_read = 5_000
    reads = ["".join(numbered[i:i + per_read]) for i in range(0, len(numbered), per_read)]
    giant = "x" * (10 << 20)  # a 10 MiB line, as the host hands it: in reads of at most 4 MiB
    reads += [giant[:READ], giant[READ:2 * READ], giant[2 * READ:] + "\n", "the last line\n"]
    size = chunks(api, run["id"], reads)

    tail = api.client.get(f"/v1/runs/{run['id']}/logs", params={"tail": 10})
    assert tail.status_code == 200
    assert len(tail.content) < 2 * LINE_CHARS + 4096, "ten lines, the giant one cut: not 10 MiB"
    page = tail.json()
    assert page["lines"][-1] == "the last line" and page["next_offset"] == size
    assert page["lines"][0].startswith("[longrun: line cut") and page["lines"][0].endswith("x" * 100)

    seen: list[str] = []
    offset, answers = 0, 0
    while True:
        answer = api.client.get(f"/v1/runs/{run['id']}/logs", params={"since_offset": offset})
        page = json.loads(answer.content)
        text = sum(len(line.encode()) + 1 for line in page["lines"])
        assert text <= ANSWER_BYTES or len(page["lines"]) == 1, "an answer holds its bound, or one line cut"
        seen += page["lines"]
        offset, answers = page["next_offset"], answers + 1
        if not page["more"]:
            break
    assert offset == size and answers > 4
    assert [line for line in seen if line.startswith("line ")] == [n[:-1] for n in numbered], "each line once"
    cut = [line for line in seen if line.startswith("x")]
    assert len(cut) == 3, "the giant line's three reads, each cut"
    assert all(len(line) < LINE_CHARS + 200 and "line cut at 65,536 of its" in line for line in cut)
    assert seen[-1] == "the last line"
