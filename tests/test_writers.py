"""Metrics writers: files read back with TensorBoard's own reader, offline W&B runs read back
record by record, the writer protocol, fan-out, and that the heavy imports stay lazy."""

import io
import json
import os
import pathlib
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from flowgrpo_eqx.train import (
    JsonlWriter,
    MetricsWriter,
    MultiWriter,
    TensorBoardWriter,
    WandbWriter,
    make_writers,
)


WORKTREE = pathlib.Path(__file__).resolve().parents[1]


def pixels(seed, height=5, width=7):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def histogram_values(seed):
    values = np.random.default_rng(seed).normal(0.3, 2.0, 257)
    # Non-finite entries are left out of every histogram.
    return np.concatenate([values, [np.nan, np.inf, -np.inf]])


class RecordingWriter:
    """A user's own writer: four plain methods, no base class."""

    def __init__(self, fail_on_close=False):
        self.calls = []
        self.closed = False
        self.fail_on_close = fail_on_close

    def scalars(self, step, values):
        self.calls.append(("scalars", step, dict(values)))

    def image(self, step, name, image):
        self.calls.append(("image", step, name))

    def histogram(self, step, name, values):
        self.calls.append(("histogram", step, name, np.asarray(values).size))

    def close(self):
        self.closed = True
        if self.fail_on_close:
            raise OSError("disk gone")


# --- TensorBoard -------------------------------------------------------------------------------


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    logdir = tmp_path / "tb"
    preview = pixels(0)
    from_file = pixels(1, height=4, width=3)
    png = tmp_path / "grid.png"
    Image.fromarray(from_file).save(png)
    values = histogram_values(2)

    writer = TensorBoardWriter(logdir)
    assert isinstance(writer, MetricsWriter)
    writer.scalars(1, {"loss": 0.5, "reward_mean": 0.1})
    writer.scalars(2, {"loss": 0.125, "reward_mean": 0.7})
    writer.image(2, "preview", preview)
    writer.image(3, "from_file", png)
    writer.histogram(2, "advantages", values)
    writer.histogram(2, "all_nan", np.full(4, np.nan))
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.scalars(3, {"loss": 0.0})

    kinds = (
        event_accumulator.COMPRESSED_HISTOGRAMS,
        event_accumulator.IMAGES,
        event_accumulator.AUDIO,
        event_accumulator.SCALARS,
        event_accumulator.HISTOGRAMS,
        event_accumulator.TENSORS,
    )
    reader = event_accumulator.EventAccumulator(str(logdir), size_guidance=dict.fromkeys(kinds, 0))
    reader.Reload()

    # Scalars are stored as float32.
    loss = reader.Scalars("loss")
    assert [event.step for event in loss] == [1, 2]
    assert [event.value for event in loss] == [0.5, 0.125]
    reward = reader.Scalars("reward_mean")
    np.testing.assert_array_equal(
        [event.value for event in reward], np.float32([0.1, 0.7]).astype(np.float64)
    )

    for tag, step, expected in (("preview", 2, preview), ("from_file", 3, from_file)):
        (event,) = reader.Images(tag)
        assert event.step == step
        assert (event.height, event.width) == expected.shape[:2]
        decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        np.testing.assert_array_equal(decoded, expected)

    (event,) = reader.Histograms("advantages")
    assert event.step == 2
    histogram = event.histogram_value
    finite = values[np.isfinite(values)]
    assert histogram.num == finite.size == 257
    assert sum(histogram.bucket) == finite.size
    assert histogram.min == finite.min()
    assert histogram.max == finite.max()
    np.testing.assert_allclose(histogram.sum, finite.sum(), rtol=1e-12)
    np.testing.assert_allclose(histogram.sum_squares, finite @ finite, rtol=1e-12)
    assert "all_nan" not in reader.Tags()["histograms"]


def test_tensorboard_writers_in_one_folder_keep_each_others_events(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    # Back to back, as when a run is resumed at once: same second, same host.
    for step in (1, 2, 3):
        writer = TensorBoardWriter(tmp_path)
        writer.scalars(step, {"loss": float(step)})
        writer.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 3
    reader = event_accumulator.EventAccumulator(str(tmp_path))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


@pytest.mark.parametrize(
    "image",
    [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8)],
)
def test_image_that_is_not_uint8_rgb_names_image(tmp_path, image):
    writer = TensorBoardWriter(tmp_path / "tb")
    try:
        with pytest.raises(ValueError, match="`image` 'preview'"):
            writer.image(1, "preview", image)
    finally:
        writer.close()


def test_empty_histogram_names_values(tmp_path):
    writer = JsonlWriter(tmp_path / "log.jsonl")
    with pytest.raises(ValueError, match="`values` of histogram 'ratio'"):
        writer.histogram(1, "ratio", np.zeros((0,)))


# --- Weights & Biases --------------------------------------------------------------------------


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with no network, no login and nothing written outside `tmp_path`."""
    pytest.importorskip("wandb")
    home = tmp_path / "wandb_home"
    home.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    # Anything that did try the server would only reach a closed port on this machine.
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("NETRC", str(home / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    return tmp_path


def wandb_records(path):
    """Decode a `.wandb` file: a LevelDB-style log of 32 KiB blocks of checksummed chunks, each
    chunk a whole record or a part of one, every record a `wandb_internal.Record` message."""
    from wandb.proto import wandb_internal_pb2

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    position, pending, records = header, b"", []
    while position + header <= len(data):
        left_in_block = block - position % block
        if left_in_block < header:
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + header])
        if (checksum, length, kind) == (0, 0, 0):
            position += left_in_block
            continue
        chunk = data[position + header : position + header + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum
        position += header + length
        pending += chunk
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_rows(records):
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def run_config(records):
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return {item.key: json.loads(item.value_json) for item in run.config.update}


def test_wandb_offline_run_written_without_network_or_login(offline_wandb):
    directory = offline_wandb / "run"
    preview = pixels(3)
    values = histogram_values(4)

    writer = WandbWriter("flowgrpo-test", directory=directory, run_name="unit", config={"lr": 0.01})
    assert isinstance(writer, MetricsWriter)
    writer.scalars(1, {"loss": 0.5, "reward_mean": 0.25})
    writer.scalars(2, {"loss": 0.125, "reward_mean": 0.75})
    writer.image(2, "preview", preview)
    writer.histogram(2, "ratio", values)
    writer.close()
    writer.close()

    run_dir = writer.run_dir
    assert run_dir.parent == directory / "wandb"
    assert run_dir.name.startswith("offline-run-")
    (run_file,) = run_dir.glob("*.wandb")
    records = wandb_records(run_file)
    assert run_config(records)["lr"] == 0.01

    rows = {row["_step"]: row for row in history_rows(records)}
    assert sorted(rows) == [1, 2]
    assert (rows[1]["loss"], rows[1]["reward_mean"]) == (0.5, 0.25)
    assert (rows[2]["loss"], rows[2]["reward_mean"]) == (0.125, 0.75)

    row = rows[2]
    assert row["preview/_type"] == "image-file"
    assert (row["preview/height"], row["preview/width"]) == preview.shape[:2]
    saved = np.asarray(Image.open(run_dir / "files" / row["preview/path"]).convert("RGB"))
    np.testing.assert_array_equal(saved, preview)

    finite = values[np.isfinite(values)]
    counts, edges = np.histogram(finite, bins=64)
    assert row["ratio/_type"] == "histogram"
    assert row["ratio/values"] == counts.tolist()
    np.testing.assert_allclose(row["ratio/bins"], edges, rtol=1e-12)


def test_make_writers_fans_out_to_tensorboard_and_wandb(offline_wandb):
    from tensorboard.backend.event_processing import event_accumulator

    directory = offline_wandb / "shapes-run"
    with make_writers(["tensorboard", "wandb"], directory, config={"epochs": 3}) as writers:
        assert [type(w) for w in writers.writers] == [TensorBoardWriter, WandbWriter]
        writers.scalars(1, {"heldout_accuracy": 0.75})
    wandb_writer = writers.writers[1]
    assert isinstance(wandb_writer, WandbWriter)

    reader = event_accumulator.EventAccumulator(str(directory / "tensorboard"))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("heldout_accuracy")] == [(1, 0.75)]

    records = wandb_records(next(wandb_writer.run_dir.glob("*.wandb")))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "shapes-run"
    assert run.project == "flowgrpo-eqx"
    assert run_config(records)["epochs"] == 3
    assert history_rows(records)[0]["heldout_accuracy"] == 0.75


def test_wandb_close_leaves_the_users_own_run_open(offline_wandb):
    import wandb

    own = wandb.init(
        project="users-own",
        dir=str(offline_wandb),
        mode="offline",
        reinit="create_new",
        settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
    )
    try:
        writer = WandbWriter("flowgrpo-test", directory=offline_wandb / "run")
        writer.scalars(1, {"loss": 0.5})
        writer.close()
        own.log({"still_open": 1.0}, step=1)
    finally:
        own.finish()
        wandb.teardown()
    rows = history_rows(wandb_records(next(writer.run_dir.glob("*.wandb"))))
    assert [row["loss"] for row in rows] == [0.5]


def test_wandb_online_without_credentials_raises_instead_of_prompting(offline_wandb):
    with pytest.raises(RuntimeError, match="credentials"):
        WandbWriter("flowgrpo-test", directory=offline_wandb / "run", mode="online")


def test_wandb_unknown_mode_names_mode(tmp_path):
    with pytest.raises(ValueError, match="`mode`"):
        WandbWriter("flowgrpo-test", directory=tmp_path, mode="sometimes")


# --- JSONL -------------------------------------------------------------------------------------


def test_jsonl_writer_records(tmp_path):
    log = tmp_path / "out" / "metrics.jsonl"
    preview = pixels(5)
    values = histogram_values(6)
    writer = JsonlWriter(log, step_key="epoch")
    writer.scalars(1, {"loss": 0.5})
    writer.image(1, "preview grid", preview)
    writer.image(2, "given", "somewhere/grid.png")
    writer.histogram(1, "advantages", values)
    writer.histogram(1, "all_nan", [np.nan])
    writer.close()

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] == {"epoch": 1, "loss": 0.5}
    assert records[1]["image"] == "preview grid"
    saved = np.asarray(Image.open(records[1]["path"]))
    np.testing.assert_array_equal(saved, preview)
    assert records[2] == {"epoch": 2, "image": "given", "path": "somewhere/grid.png"}
    finite = values[np.isfinite(values)]
    assert records[3]["count"] == finite.size
    assert (records[3]["min"], records[3]["max"]) == (finite.min(), finite.max())
    np.testing.assert_allclose(records[3]["sum"], finite.sum(), rtol=1e-12)
    np.testing.assert_allclose(records[3]["sum_squares"], finite @ finite, rtol=1e-12)
    assert len(records) == 4


# --- Protocol, fan-out, names, lazy imports ----------------------------------------------------


def test_users_own_writer_satisfies_protocol():
    assert isinstance(RecordingWriter(), MetricsWriter)

    class NoClose:
        def scalars(self, step, values): ...

        def image(self, step, name, image): ...

        def histogram(self, step, name, values): ...

    assert not isinstance(NoClose(), MetricsWriter)


def test_multi_writer_fans_out_and_closes_all_despite_an_error():
    first, second = RecordingWriter(fail_on_close=True), RecordingWriter()
    writers = MultiWriter([first, second])
    assert isinstance(writers, MetricsWriter)
    writers.scalars(3, {"loss": 1.0})
    writers.image(3, "preview", pixels(7))
    writers.histogram(3, "ratio", np.ones(6))
    expected = [
        ("scalars", 3, {"loss": 1.0}),
        ("image", 3, "preview"),
        ("histogram", 3, "ratio", 6),
    ]
    assert first.calls == second.calls == expected
    with pytest.raises(OSError, match="disk gone"):
        writers.close()
    assert first.closed and second.closed


def test_make_writers_tensorboard_only(tmp_path):
    writers = make_writers(["tensorboard"], tmp_path)
    try:
        (writer,) = writers.writers
        assert isinstance(writer, TensorBoardWriter)
        assert writer.logdir == tmp_path / "tensorboard"
    finally:
        writers.close()
    assert make_writers([], tmp_path).writers == ()


@pytest.mark.parametrize(
    ("names", "message"),
    [(["tensorboard", "bogus"], "'bogus'"), (["tensorboard", "tensorboard"], "twice")],
)
def test_make_writers_bad_names(tmp_path, names, message):
    with pytest.raises(ValueError, match=message):
        make_writers(names, tmp_path)
    # Checked before any writer is made.
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.several_processes("imports the library in a fresh process")
def test_importing_train_loads_neither_tensorboardx_nor_wandb():
    environment = {**os.environ, "PYTHONPATH": str(WORKTREE)}
    check = (
        "import flowgrpo_eqx.train, sys; "
        "assert flowgrpo_eqx.train.__file__.startswith(sys.argv[1]), flowgrpo_eqx.train.__file__; "
        "assert 'tensorboardX' not in sys.modules and 'wandb' not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(WORKTREE)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
