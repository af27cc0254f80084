"""A run folder holds one run: reusing it, resuming with other settings, or diverging is
refused by name, before any work, and nothing of the old run is touched."""

import json
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flowgrpo_eqx.train as fg_train
from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.shapes_demo.run_folder import FREE_ON_RESUME, LOCK_FILE, identity
from tests.cli_helpers import TIMEOUT, command, environment, epochs_done, run_cli, with_base


TINY = ("train", "--preset", "tiny", "--quiet")


def snapshot(folder):
    """Every file under `folder` with its bytes (but the lock file, which says who last
    wrote the folder)."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


@pytest.fixture(scope="module")
def finished_run(tiny_base, tmp_path_factory):
    """A tiny run of two epochs, checkpointed after each, and its files' bytes."""
    out = with_base(tiny_base, tmp_path_factory.mktemp("finished") / "run")
    result = run_cli(*TINY, "--epochs", "2", "--checkpoint-every", "1", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, snapshot(out)


def refused(finished_run, tmp_path, *flags):
    """A copy of the finished run, `train` run on it with `flags`, and the copy's files."""
    out, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "2", "--out", copy, *flags)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(copy) == before, "a refused run changed the folder"
    return result.stderr


@pytest.mark.parametrize("command", ["train", "seeds", "pretrain", "eval"])
def test_an_out_that_is_a_file_is_refused_saying_a_folder_is_needed(
    finished_run, tmp_path, command
):
    """`--out` naming a file gave "[Errno 17] File exists" (eval: after measuring)."""
    out, _ = finished_run
    arguments = {
        "train": TINY,
        "seeds": (*TINY, "--seeds", "0,1"),
        "pretrain": ("pretrain", "--preset", "tiny", "--quiet"),
        "eval": ("eval", "--checkpoint", out / "policy.eqx", "--quiet"),
    }[command]
    blocker = tmp_path / "results"
    blocker.write_text("notes\n")
    for target, where in (
        (blocker, "is a file"),
        (blocker / "run", f"lies under {blocker}, which is a file"),
    ):
        result = run_cli(*arguments, "--out", target)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        (line,) = result.stderr.splitlines()
        assert f"`--out` {target} {where}, not a folder: " in line
        assert "Pass the path of a folder" in line
    assert blocker.read_text() == "notes\n"


def test_every_checkpoint_records_the_run_settings(finished_run):
    out, _ = finished_run
    metas = sorted((out / "checkpoints").glob("*/meta.json"))
    assert len(metas) == 2
    want = identity(make_config("tiny", epochs=2, checkpoint_every=1))
    for meta in metas:
        assert json.loads(meta.read_text())["settings"] == want
    assert not FREE_ON_RESUME & set(want)
    assert {"learning_rate", "groups", "reward", "seed", "algorithm"} <= set(want)


def test_training_into_a_folder_that_holds_a_run_is_refused(finished_run, tmp_path):
    message = refused(finished_run, tmp_path)
    assert "holds another run" in message and "--resume" in message and "--replace" in message


@pytest.mark.parametrize(
    "flag, value, recorded",
    [
        ("--learning-rate", "0.003", "0.01"),
        ("--groups", "2", "4"),
        ("--reward", "strict", "'jpeg_incompressibility'"),
        ("--seed", "5", "0"),
        ("--algorithm", "nft", "'flow_grpo'"),
    ],
)
def test_resuming_with_a_changed_setting_names_both_values(
    finished_run, tmp_path, flag, value, recorded
):
    name = flag[2:].replace("-", "_")
    config = make_config("tiny")
    assert repr(config.settings()[name]) == recorded
    message = refused(finished_run, tmp_path, "--resume", flag, value)
    assert f"{name}: {recorded} in the checkpoint" in message
    assert "now" in message and value in message


def test_a_refused_resume_does_no_work_first(finished_run, tmp_path):
    """A wider model has another base: the refusal comes before it would be pretrained."""
    message = refused(finished_run, tmp_path, "--resume", "--width", "32")
    assert "width: 16 in the checkpoint, 32 now" in message


def test_fewer_epochs_than_done_is_refused(finished_run, tmp_path):
    out, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "1", "--resume", "--out", copy)
    assert result.returncode == 1
    assert "`epochs`=1 is below the 2 epochs" in result.stderr
    assert snapshot(copy) == before


def test_replace_moves_the_old_run_aside_and_trains_afresh(finished_run, tmp_path):
    out, files = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    result = run_cli(*TINY, "--epochs", "1", "--replace", "--out", copy)
    assert result.returncode == 0, result.stderr[-3000:]
    moved = tmp_path / "run.replaced-1"
    assert snapshot(moved) == files
    assert (copy / "policy.eqx").exists()
    assert len(list((copy / "checkpoints").iterdir())) == 1


def test_a_diverging_run_stops_by_name_and_writes_no_policy(tiny_base, tmp_path):
    out = with_base(tiny_base, tmp_path / "run")
    result = run_cli(
        *TINY, "--epochs", "2", "--learning-rate", "1e30", "--max-grad-norm", "1e30",
        "--out", out,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Training diverged in epoch 1" in result.stderr and "Traceback" not in result.stderr
    assert not (out / "policy.eqx").exists() and not (out / "summary.json").exists()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_divergence_after_good_epochs_keeps_their_checkpoints(tiny_base, tmp_path, monkeypatch):
    """Epochs 1 and 2 train and checkpoint; epoch 3's divergence (stood in for here: the
    check finds the policy non-finite) stops the run with them intact and no policy."""
    import flowgrpo_eqx.train._loops as loops

    real = loops.check_finite

    def diverge_in_epoch_three(epoch, metrics, policy):
        if epoch == 3:
            raise fg_train.TrainingDiverged(epoch, metrics, "the policy's parameters")
        real(epoch, metrics, policy)

    monkeypatch.setattr(loops, "check_finite", diverge_in_epoch_three)
    out = with_base(tiny_base, tmp_path / "run")
    result = run_cli(*TINY, "--epochs", "4", "--checkpoint-every", "1", "--out", out)
    assert result.returncode == 1
    assert "Training diverged in epoch 3: the policy's parameters" in result.stderr
    kept = sorted(path.name for path in (out / "checkpoints").iterdir())
    assert len(kept) == 2 and kept[-1].endswith("2")
    assert not (out / "policy.eqx").exists()
    resumed = run_cli(*TINY, "--epochs", "2", "--resume", "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Continuing from checkpoint" in resumed.stdout + resumed.stderr


# One writer at a time, and a resume that loses nothing.


def copy_of(finished_run, tmp_path):
    out, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return copy


@pytest.mark.several_processes("locks a run folder from a second process")
def test_a_second_writer_is_refused_naming_the_first(finished_run, tmp_path):
    """Two `--resume` processes on one folder both ran and interleaved its files."""
    copy = copy_of(finished_run, tmp_path)
    before = snapshot(copy)
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import pathlib, sys; from flowgrpo_eqx.shapes_demo.run_folder import "
            "lock_run_folder\nwith lock_run_folder(pathlib.Path(sys.argv[1])):\n"
            "    print('locked', flush=True); sys.stdin.read()",
            str(copy),
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment(),
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run_cli(*TINY, "--epochs", "3", "--resume", "--out", copy)
    finally:
        holder.communicate("", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"is in use by another run (pid {holder.pid} on host " in line
    assert snapshot(copy) == before
    again = run_cli(*TINY, "--epochs", "2", "--resume", "--out", copy)
    assert again.returncode == 0, again.stderr[-2000:]


def test_resuming_a_finished_run_writes_nothing(finished_run, tmp_path):
    copy = copy_of(finished_run, tmp_path)
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "2", "--resume", "--out", copy)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "is finished (2 epochs): nothing to resume, nothing written" in result.stdout
    assert snapshot(copy) == before


@pytest.mark.parametrize("flags", [(), ("--learning-rate", "0.003")], ids=["same", "other"])
def test_resuming_a_finished_run_whose_checkpoints_are_gone_is_refused(
    finished_run, tmp_path, flags
):
    """It started over and overwrote policy.eqx, summary.json, config.toml and the metrics,
    with other settings, exit 0."""
    copy = copy_of(finished_run, tmp_path)
    shutil.rmtree(copy / "checkpoints")
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "2", "--resume", "--out", copy, *flags)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "holds a finished run (summary.json, policy.eqx) and no checkpoint" in result.stderr
    assert snapshot(copy) == before


@pytest.mark.parametrize("left", ["an unfinished write", "nothing"])
def test_resuming_a_run_without_a_complete_checkpoint_says_what_happened(
    finished_run, tmp_path, left
):
    """A SIGKILL during a run's first checkpoint write (or a write that failed, say past a
    file-size limit) left a folder whose --resume said it "holds a run that checkpointed, but
    no checkpoint is left": no checkpoint had ever completed."""
    copy = copy_of(finished_run, tmp_path)
    for name in ("summary.json", "policy.eqx"):
        (copy / name).unlink()
    checkpoints = copy / "checkpoints"
    first = checkpoints / "ckpt_00000001"
    for checkpoint in checkpoints.iterdir():
        if checkpoint != first:
            shutil.rmtree(checkpoint)
    if left == "nothing":
        shutil.rmtree(first)
    else:
        # The save writes into `.tmp-<step>` and renames it when complete; killed first.
        (first / "meta.json").unlink()
        first.rename(checkpoints / ".tmp-00000001")
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "2", "--resume", "--out", copy)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert f"{copy} holds a run with no checkpoint to resume from: " in line
    if left == "nothing":
        assert f"its checkpoints folder {checkpoints} is empty" in line
    else:
        assert "stopped while writing its first checkpoint, which never completed" in line
        assert str(checkpoints / ".tmp-00000001") in line
    restart = f"flowgrpo-eqx train --config {copy / 'config.toml'} --out {copy} --replace"
    assert f"Start it afresh in the same folder with: {restart} (the old run's files" in line
    assert f"move to {copy.parent / 'run.replaced-1'})" in line
    assert "checkpointed, but" not in line
    assert snapshot(copy) == before


@pytest.mark.several_processes("runs a process under a file-size limit")
def test_a_first_checkpoint_that_cannot_be_written_then_resume_gives_the_command_that_starts_over(
    tiny_base, tmp_path
):
    """Under `ulimit -f 100` the run stopped with a named error, then `--resume` refused
    (no checkpoint exists) and said only to pass --replace: it now gives the command that
    starts the run afresh in the same folder, and that command does."""
    out = with_base(tiny_base, tmp_path / "run")
    train = command(*TINY, "--epochs", "2", "--checkpoint-every", "1", "--out", str(out))
    limited = ["sh", "-c", 'ulimit -f 100 && exec "$@"', "sh", *train]
    # No compilation cache: an entry past the limit would not be written.
    env = {k: v for k, v in environment().items() if k != "JAX_COMPILATION_CACHE_DIR"}
    stopped = subprocess.run(limited, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    assert "File too large while writing a checkpoint" in stopped.stderr
    resumed = run_cli(*TINY, "--epochs", "2", "--checkpoint-every", "1", "--resume", "--out", out)
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    (line,) = resumed.stderr.splitlines()
    restart = f"flowgrpo-eqx train --config {out / 'config.toml'} --out {out} --replace"
    assert f"Start it afresh in the same folder with: {restart} " in line
    program, *arguments = shlex.split(restart)
    assert program == "flowgrpo-eqx"
    again = run_cli(*arguments, "--quiet")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"Moved the run that was in {out} to {out.parent / 'run.replaced-1'}" in again.stdout
    assert epochs_done(out) == 2


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda meta: meta.update(epoch=-3), "records epoch -3 at step 2"),
        (lambda meta: meta.pop("base"), "records no `base` measure"),
        (lambda meta: meta.update(settings=None), "records no `settings`"),
    ],
    ids=["epoch-minus-3", "no-base", "no-settings"],
)
def test_a_checkpoint_that_does_not_parse_is_named_and_cuts_nothing(
    finished_run, tmp_path, edit, named
):
    """A hand-edited epoch of -3 emptied metrics.jsonl; meta.json without `base` raised a raw
    KeyError."""
    copy = copy_of(finished_run, tmp_path)
    meta_path = copy / "checkpoints" / "ckpt_00000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "3", "--resume", "--out", copy)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{copy / 'checkpoints' / 'ckpt_00000002'}: meta.json {named}" in line
    assert snapshot(copy) == before


@pytest.mark.parametrize(
    ("line", "named"),
    [(b'{"epoch": "x"}', 'line 2 ({"epoch": "x"}) cannot be read'),
     (b"\xff\xfe\x00 not text", "line 2 is not a JSON object")],
    ids=["epoch-x", "not-utf8"],
)  # fmt: skip
def test_a_metrics_line_that_does_not_parse_is_named_and_cuts_nothing(
    finished_run, tmp_path, line, named
):
    """A mid-file `{"epoch": "x"}` raised a raw TypeError on resume; bytes that are not
    UTF-8 a raw UnicodeDecodeError (the fault probe)."""
    copy = copy_of(finished_run, tmp_path)
    metrics = copy / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join([lines[0], line + b"\n", *lines[1:]]))
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "3", "--resume", "--out", copy)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{metrics}: {named}" in result.stderr
    assert "nothing was cut" in result.stderr
    assert snapshot(copy) == before  # config.toml too: written only after loading


def test_a_failed_resume_leaves_config_toml_as_it_was(finished_run, tmp_path):
    copy = copy_of(finished_run, tmp_path)
    for checkpoint in (copy / "checkpoints").iterdir():
        (checkpoint / "meta.json").write_text("{not json")
    before = snapshot(copy)
    result = run_cli(*TINY, "--epochs", "3", "--eval-every", "3", "--resume", "--out", copy)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "none of its 2 checkpoints is usable" in result.stderr
    assert snapshot(copy) == before


def test_a_sweep_resumes_each_seed(tiny_base, tmp_path):
    """`--seeds` could not be resumed, yet its refusal said "continue it with --resume".
    The sweep's summary holds each figure's statistics over the seeds' runs."""
    out = tmp_path / "sweep"
    # The first seed finds the session's base model in its folder; the second copies it.
    with_base(tiny_base, out / "seed_0")
    sweep = (*TINY, "--seeds", "0,1", "--epochs", "1", "--out", out)
    first = run_cli(*sweep)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(*sweep)
    assert again.returncode == 1 and "--resume" in again.stderr
    finished = run_cli(*sweep, "--resume")
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.count("is finished (1 epochs)") == 2
    longer = run_cli(*sweep, "--epochs", "2", "--resume")
    assert longer.returncode == 0, longer.stderr[-2000:]
    for seed in (0, 1):
        assert f"Continuing from checkpoint {out / f'seed_{seed}' / 'checkpoints'}" in longer.stdout
        assert json.loads((out / f"seed_{seed}" / "summary.json").read_text())["epochs"] == 2
    summary = json.loads((out / "seeds_summary.json").read_text())
    assert summary["seeds"] == [0, 1]
    runs = [json.loads((out / f"seed_{s}" / "summary.json").read_text()) for s in (0, 1)]
    for name in ("final_accuracy", "train_reward_last_epoch", "wall_seconds"):
        values = np.asarray([run[name] for run in runs], np.float64)
        figure = summary[name]
        assert figure["mean"] == pytest.approx(values.mean())
        assert figure["std"] == pytest.approx(values.std())
        assert figure["worst"] == values.min() and figure["best"] == values.max()
    base_files = [sorted((out / f"seed_{s}").glob("base_*.eqx")) for s in (0, 1)]
    assert base_files[0][0].read_bytes() == base_files[1][0].read_bytes()
    assert (out / "seeds_accuracy.png").stat().st_size > 0
