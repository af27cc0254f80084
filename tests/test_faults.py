"""Faults that once gave raw tracebacks or left a run folder behind, each a one-line named error
before any work: settings no model or key can hold, a device count the machine lacks, a
reward that cannot be called, a coordinator without a port, and `--preset` before the
subcommand (which now works)."""

import pytest

from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.shapes_demo.settings import MAX_PARAMETERS, MAX_SEED
from tests.cli_helpers import run_cli


def one_line(result):
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("name", ["seed", "pretrain_seed", "eval_seed"])
def test_a_seed_no_key_can_hold_is_refused_before_any_work(tmp_path, name):
    """`seed = 99999999999999999999` in a config raised OverflowError after pretraining,
    leaving config.toml behind."""
    config = tmp_path / "config.toml"
    config.write_text(f"{name} = 99999999999999999999\n")
    out = tmp_path / "run"
    result = run_cli("train", "--preset", "tiny", "--config", config, "--out", out)
    assert result.returncode == 2
    assert f"`{name}` must be an int in 0..{MAX_SEED}" in one_line(result)
    assert not out.exists()
    make_config("tiny", **{name: MAX_SEED})  # the bound itself is a seed


def test_a_model_too_large_to_allocate_is_refused_by_name(tmp_path):
    """`width = 1000000000` aborted the process with std::bad_alloc."""
    out = tmp_path / "run"
    result = run_cli("train", "--preset", "tiny", "--width", "1000000000", "--out", out)
    assert result.returncode == 2
    line = one_line(result)
    assert "Settings `width` (1000000000) and `depth`" in line and "MAX_PARAMETERS" in line
    assert not out.exists()
    with pytest.raises(ValueError, match="`width`"):
        make_config("tiny", width=int((MAX_PARAMETERS / 12) ** 0.5) + 1, depth=1)


def test_more_devices_than_there_are_is_refused_before_pretraining(tmp_path):
    """`--devices 4` on one device failed only after pretraining."""
    import jax

    out = tmp_path / "run"
    asked = jax.device_count() + 3
    result = run_cli("train", "--preset", "tiny", "--devices", asked, "--out", out)
    assert result.returncode == 1
    assert f"`devices` must be an int in 1..{jax.device_count()}" in one_line(result)
    assert not out.exists()


def test_preset_before_the_subcommand_works():
    """`flowgrpo-eqx --preset tiny train` gave "invalid choice"."""
    before = run_cli("--preset", "tiny", "train", "--print-config")
    after = run_cli("train", "--preset", "tiny", "--print-config")
    assert before.returncode == after.returncode == 0, before.stderr
    assert before.stdout == after.stdout
    assert before.stdout != run_cli("train", "--print-config").stdout
    disagree = run_cli("--preset", "tiny", "train", "--preset", "default", "--print-config")
    assert disagree.returncode == 2 and "disagree" in disagree.stderr
    nowhere = run_cli("--preset", "tiny", "serve-reward", "partial")
    assert nowhere.returncode == 2 and "serve-reward takes no --preset" in nowhere.stderr


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--heads", "3"), "`heads` (3) must divide `width` (16)"),
        (("--patch", "5"), "`patch` (5) must divide `image_size` (16)"),
        (("--custom-reward", "json:no_such"), "Reward 'json:no_such' cannot be loaded"),
        (("--custom-reward", "os:getcwd"), "Reward 'os:getcwd' must be called as reward(samples"),
    ],
    ids=["heads", "patch", "missing-reward", "uncallable-reward"],
)
def test_what_the_model_and_reward_refuse_leaves_no_run_folder(tmp_path, flags, named):
    """The model's and the reward's own checks ran after the run folder was locked (leaving
    `run.lock`), and `os:getcwd` as a reward failed only after pretraining, leaving a run
    folder with a base model (the fault probe)."""
    out = tmp_path / "run"
    result = run_cli("train", "--preset", "tiny", "--quiet", *flags, "--out", out)
    assert result.returncode == 1
    assert named in one_line(result)
    assert not out.exists()


def test_a_coordinator_without_a_port_is_named():
    """`--coordinator nohost` raised IndexError from deep inside jax.distributed."""
    result = run_cli(
        "train", "--preset", "tiny", "--num-processes", "2", "--process-id", "0",
        "--coordinator", "nohost",
    )  # fmt: skip
    assert result.returncode == 1
    assert "`coordinator` must be HOST:PORT (a port in 1..65535), got 'nohost'" in one_line(result)


@pytest.mark.parametrize(
    ("seeds", "named"),
    [("a,b", "expected comma-separated ints"), ("1,1", "repeats a seed"), (",", "expected")],
)
def test_seeds_that_are_not_distinct_ints_are_refused_before_any_work(tmp_path, seeds, named):
    """`--seeds a,b` raised a bare "invalid literal for int()" after the settings were made
    (the fault probe)."""
    out = tmp_path / "sweep"
    result = run_cli("train", "--preset", "tiny", "--seeds", seeds, "--out", out)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument --seeds: {named}" in result.stderr.strip().splitlines()[-1]
    assert not out.exists()


def test_launching_no_process_names_the_flag():
    result = run_cli("launch", "--local", "0", "train", "--preset", "tiny")
    assert result.returncode == 2
    assert "`processes` (--local) must be an int >= 1, got 0." in one_line(result)
