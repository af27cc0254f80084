"""Atomic files and JSON Lines logs: whole or not at all, one format for every log."""

import pytest

from flowgrpo_eqx._files import atomic_file, jsonl_line
from flowgrpo_eqx.train import JsonlWriter, MetricsLog


def test_an_atomic_file_replaces_the_old_one_only_when_complete(tmp_path):
    path = tmp_path / "deeper" / "file.bin"
    with atomic_file(path) as handle:
        handle.write(b"old")
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_file(path) as handle:
            handle.write(b"new, but not all of it")
            raise RuntimeError("midway")
    assert path.read_bytes() == b"old"
    assert [p.name for p in path.parent.iterdir()] == ["file.bin"]
    with atomic_file(path) as handle:
        handle.write(b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in path.parent.iterdir()] == ["file.bin"]


def test_metrics_log_and_jsonl_writer_write_the_same_lines(tmp_path):
    log = MetricsLog(tmp_path / "log.jsonl")
    writer = JsonlWriter(tmp_path / "writer.jsonl", step_key="epoch")
    log.write({"epoch": 1, "b": 2.0, "a": 1.0})
    writer.scalars(1, {"b": 2.0, "a": 1.0})
    assert (tmp_path / "log.jsonl").read_text() == (tmp_path / "writer.jsonl").read_text()
    assert (tmp_path / "log.jsonl").read_text() == jsonl_line({"a": 1.0, "b": 2.0, "epoch": 1})
    log.write({"epoch": 2})
    log.keep_only(lambda record: record["epoch"] < 2)
    assert log.read() == [{"a": 1.0, "b": 2.0, "epoch": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "writer.jsonl"]


def test_a_torn_last_line_is_cut_back_on_resume_and_named(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"epoch": 1, "loss": 0.5})
    log.write({"epoch": 2, "loss": 0.4})
    with open(log.path, "a") as handle:
        handle.write('{"epoch": 3, "lo')
    with pytest.raises(ValueError, match="line 3 is not a JSON object"):
        log.read()
    said = []
    log.keep_only(lambda record: record["epoch"] <= 2, report=said.append)
    assert said == [f"Cut back the torn last line 3 of {log.path}."]
    assert log.read() == [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4}]


def test_a_damaged_line_before_the_last_is_named(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.path.write_text('{"epoch": 1}\nnot json\n{"epoch": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        log.keep_only(lambda record: True, report=print)
