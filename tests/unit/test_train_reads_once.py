"""A training run opens its `--data-dir` and reads its verifier's config once: the draft's layer ids and the loaders
come from the same opening (they were two, each listing and checking every sample file)."""

from pathlib import Path

from tests.trainer.tiny_setup import build_dataset, build_verifier


def test_a_run_opens_its_data_and_reads_its_verifier_config_once(tmp_path: Path, monkeypatch, capsys) -> None:
    import torch  # here, not at collection: the unit lane's processes that never run this test skip torch's import

    import trainer.train

    monkeypatch.delenv("LONGRUN_METRICS_FILE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verifier = build_verifier(tmp_path / "verifier")
        build_dataset(verifier, tmp_path / "data", samples=6, length=16)
        calls: dict[str, int] = {}

        def counted(name: str):
            real = getattr(trainer.train, name)

            def call(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return real(*args, **kwargs)
            monkeypatch.setattr(trainer.train, name, call)

        counted("open_training_data")
        counted("read_verifier_config")
        code = trainer.train.main([
            "--verifier-path", str(tmp_path / "verifier"), "--data-dir", str(tmp_path / "data" / "hidden_states"),
            "--vocab-mapping-dir", str(tmp_path / "data" / "vocab_mapping"), "--output-dir", str(tmp_path / "out"),
            "--max-steps", "2", "--max-seq-len", "16", "--num-workers", "0", "--sim-depth", "0", "--val-ratio", "0.2"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and "done: 2 steps" in capsys.readouterr().out
    assert calls == {"open_training_data": 1, "read_verifier_config": 1}
