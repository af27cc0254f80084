"""A setting the chosen algorithm does not read is refused, or (from a config file) left at its
default with one warning; it is never accepted, written to `config.toml` and ignored.

`--dppo-kl-threshold 0.5` with `--algorithm flow_grpo`, and `--clip-range 0.01` with
`--algorithm dppo` (Flow-DPPO has no ratio clip), were both accepted and ignored. Each
algorithm now declares which of `ALGORITHM_SETTINGS` it reads, and the declaration is checked
against what it builds: changing a setting it does not read changes nothing of its objective
or its rollout.
"""

import dataclasses
import pathlib
from typing import Any

import equinox as eqx
import pytest

from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.shapes_demo.algorithms import ALGORITHM_SETTINGS, ALGORITHMS
from flowgrpo_eqx.shapes_demo.config import (
    SETTINGS,
    JobConfig,
    UnreadSettingWarning,
    config_to_toml,
    readers,
)
from flowgrpo_eqx.shapes_demo.parts import ShapesJob
from tests.cli_helpers import run_cli


@pytest.mark.parametrize(
    ("flags", "setting", "algorithm", "read_by"),
    [
        (["--dppo-kl-threshold", "0.5"], "dppo_kl_threshold", "flow_grpo", "dppo"),
        (["--algorithm", "dppo", "--clip-range", "0.01"], "clip_range", "dppo", "flow_grpo"),
        (["--algorithm", "dppo", "--clip-range", "0.2"], "clip_range", "dppo", "dgpo"),
        (["--algorithm", "dgpo", "--grpo-guard", "true"], "grpo_guard", "dgpo", "mixgrpo"),
        (["--algorithm", "nft", "--noise-level", "0.3"], "noise_level", "nft", "awm"),
        (["--algorithm", "awm", "--window-stride", "2"], "window_stride", "awm", "dppo"),
        (["--algorithm", "flow_grpo", "--nft-old-decay", "0.1"], "nft_old_decay", "flow_grpo",
         "nft"),
    ],
    ids=[
        "dppo_kl_threshold with flow_grpo",
        "clip_range with dppo",
        "clip_range at its default with dppo",
        "grpo_guard with dgpo",
        "noise_level with nft",
        "window_stride with awm",
        "nft_old_decay with flow_grpo",
    ],
)  # fmt: skip
def test_a_named_setting_the_algorithm_does_not_read_is_refused_naming_who_reads_it(
    flags: list[str], setting: str, algorithm: str, read_by: str
) -> None:
    result = run_cli("train", "--preset", "tiny", *flags, "--print-config")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert f"Setting `{setting}`" in line
    assert f"is not read by algorithm '{algorithm}'" in line
    assert f"read by {', '.join(readers(setting))})" in line and read_by in readers(setting)
    assert result.stdout == ""  # no config.toml to write


def test_the_library_refuses_such_a_setting_at_another_value_wherever_it_comes_from() -> None:
    with pytest.raises(ValueError, match=r"`clip_range`=0.01 \(read by flow_grpo.*\) is not read"):
        make_config("tiny", algorithm="dppo", clip_range=0.01)
    dppo = make_config("tiny", algorithm="dppo")
    with pytest.raises(ValueError, match=r"Setting `clip_range`=0.01 \(read by flow_grpo"):
        dppo.replace(clip_range=0.01)
    with pytest.raises(ValueError, match=r"`dppo_kl_threshold`=0.5 \(read by dppo\)"):
        make_config("tiny").replace(dppo_kl_threshold=0.5)
    # An algorithm's own checks keep their words.
    with pytest.raises(ValueError, match="`beta` .* must be 0 with algorithm 'dppo'"):
        make_config("tiny", algorithm="dppo", beta=0.01)


def test_a_config_files_setting_the_algorithm_does_not_read_is_left_at_its_default_with_a_warning(
    tmp_path: pathlib.Path,
) -> None:
    file = tmp_path / "settings.toml"
    file.write_text("clip_range = 0.01\ngrpo_guard = true\ndppo_kl_threshold = 0.001\n")
    result = run_cli("train", "--preset", "tiny", "--algorithm", "dppo", "--config", file,
                     "--print-config")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("flowgrpo-eqx: warning: Settings `clip_range`=0.01 (read by flow_grpo")
    assert "`grpo_guard`=True (read by flow_grpo" in line
    assert "of the config file are not read by algorithm 'dppo': left at their defaults." in line
    written = result.stdout.splitlines()
    assert "clip_range = 0.2" in written and "grpo_guard = false" in written
    assert "dppo_kl_threshold = 0.001" in written
    # The library warns once, with the same words.
    with pytest.warns(UnreadSettingWarning, match="`clip_range`=0.01") as caught:
        config = make_config(
            "tiny", file_settings={"clip_range": 0.01, "grpo_guard": True}, algorithm="dppo"
        )
    assert len(caught) == 1 and config.objective.clip_range == 0.2


def test_a_runs_own_config_toml_gives_no_warning_under_another_algorithm(
    tmp_path: pathlib.Path,
) -> None:
    """A run's `config.toml` holds every setting; those its algorithm does not read are at
    their defaults, so it reads without a warning under an algorithm that takes its
    algorithm's values (a DGPO run's `beta` 0.02 under `nft` is warned of: nft does not read
    it)."""
    file = tmp_path / "config.toml"
    for written, algorithm in [("flow_grpo", "dppo"), ("flow_grpo", "awm"), ("dppo", "flow_grpo"),
                               ("nft", "dppo"), ("nft", "flow_grpo")]:  # fmt: skip
        file.write_text(config_to_toml(make_config("tiny", algorithm=written)))
        result = run_cli("train", "--config", file, "--algorithm", algorithm, "--print-config")
        assert result.returncode == 0 and result.stderr == "", (written, algorithm, result.stderr)


ANOTHER_VALUE: dict[str, Any] = {
    "nft_beta": 0.5,
    "nft_old_decay": 0.25,
    "dppo_kl_threshold": 1e-3,
    "dppo_kl_std": "transition",
    "beta": 0.01,
    "clip_range": 0.05,
    "grpo_guard": True,
    "adv_clip_max": 2.0,
    "transition_chunk": 1,
    "old_log_probs": "update",
    "noise_level": 0.3,
    "sde_steps": 1,
    "train_steps": 1,
    "window_schedule": "random",
    "window_shift_every": 3,
    "window_stride": 2,
}
"""A valid value other than the default for each setting of `ALGORITHM_SETTINGS`."""


def _unchecked(config: JobConfig, name: str, value: Any) -> JobConfig:
    """`config` with one setting changed, its section checked but not the whole (which would
    refuse a setting its algorithm does not read)."""
    section = SETTINGS[name].section
    changed = dataclasses.replace(getattr(config, section), **{name: value})
    made = object.__new__(JobConfig)
    for field in dataclasses.fields(JobConfig):
        value = changed if field.name == section else getattr(config, field.name)
        object.__setattr__(made, field.name, value)
    return made


def test_every_setting_has_another_value_to_try() -> None:
    assert set(ANOTHER_VALUE) == ALGORITHM_SETTINGS


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_setting_an_algorithm_declares_unread_changes_nothing_it_builds(
    name: str, tmp_path: pathlib.Path
) -> None:
    algorithm = ALGORITHMS[name]  # type: ignore[index]
    config = make_config("tiny", algorithm=name)
    job = ShapesJob(config, tmp_path, True)

    def built(config: JobConfig) -> tuple[Any, Any]:
        pieces = dataclasses.replace(job.pieces(), config=config)
        objective = algorithm.objective(pieces, job.model)
        return objective, algorithm.rollout(pieces, objective, None)

    reference = built(config)
    unread = sorted(ALGORITHM_SETTINGS - algorithm.reads)
    assert unread or name in ("flow_grpo", "mixgrpo", "mixgrpo-flash", "mixgrpo-flash-star")
    for setting in unread:
        changed = built(_unchecked(config, setting, ANOTHER_VALUE[setting]))
        assert eqx.tree_equal(changed, reference), f"{name} reads {setting}"


def test_a_run_checkpointed_with_a_setting_its_algorithm_ignored_still_resumes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose checkpoints record `clip_range` 0.01 under `dppo` (accepted and ignored
    before) resumes: its config file's value is left at the default, and a setting the
    algorithm does not read cannot change what the run computes."""
    from flowgrpo_eqx.shapes_demo import run_folder

    config = make_config("tiny", algorithm="dppo")
    recorded = {**run_folder.identity(config), "clip_range": 0.01}
    metadata = {"epoch": 1, "step": 1, "settings": recorded,
                "base": {"accuracy": 0.5, "reward": 0.1, "diversity": 1.0}}  # fmt: skip

    class Found:
        def __init__(self, directory: pathlib.Path) -> None:
            del directory

        def latest_metadata(self) -> tuple[dict[str, Any], pathlib.Path]:
            return metadata, tmp_path / "checkpoints" / "ckpt_00000001"

    monkeypatch.setattr(run_folder, "Checkpointer", Found)
    run_folder.check_run_folder(tmp_path, config, resume=True)
    recorded["dppo_kl_threshold"] = 0.5
    with pytest.raises(run_folder.RunFolderError, match="dppo_kl_threshold: 0.5 in the checkpoint"):
        run_folder.check_run_folder(tmp_path, config, resume=True)
