"""`flowgrpo-eqx finetune`'s configuration: the shipped recipes read, every default prints and
reads back, overrides apply, and a misspelt key, another algorithm's table or a reward key its
kind does not read is refused by name."""

import pathlib

import pytest

from flowgrpo_eqx.finetune import ConfigError, config_to_toml, read_config
from flowgrpo_eqx.finetune._algorithms import ALGORITHM_TABLES
from flowgrpo_eqx.finetune._config import apply_override, config_from_table

from .finetune_helpers import tiny_table, write_config


CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_each_shipped_recipe_reads_and_cites_its_release(path: pathlib.Path) -> None:
    config = read_config(path)
    assert "github" in path.read_text().split("\n\n")[0]  # the comment names the release
    rows = config.sampling.prompts_per_epoch * config.sampling.group_size
    assert rows % config.training.updates_per_epoch == 0


def test_the_pickscore_recipe_is_flow_grpos() -> None:
    """flow_grpo's `pickscore_sd3` with `train_sd3.py`'s LoRA and T5 length."""
    config = read_config(CONFIGS / "sd35_medium_pickscore.toml")
    table = config.algorithm_table
    assert config.algorithm.name == "flow_grpo"
    assert (table.clip_range, table.beta, table.adv_clip_max, table.noise_level) == (  # type: ignore[attr-defined]
        1e-4,
        0.01,
        5.0,
        0.7,
    )
    assert (config.sampling.group_size, config.sampling.prompts_per_epoch) == (24, 48)
    assert (config.sampling.train_steps, config.sampling.eval_steps) == (10, 40)
    assert (config.lora.rank, config.lora.alpha, config.prompts.text_length) == (32, 64.0, 128)
    assert (config.training.learning_rate, config.training.ema_decay) == (3e-4, 0.9)


def test_print_config_reads_back_to_the_same_configuration(tmp_path: pathlib.Path) -> None:
    config = read_config(write_config(tmp_path / "a.toml", tiny_table(tmp_path, "sd35")))
    resolved = config.resolved()
    printed = tmp_path / "printed.toml"
    printed.write_text(config_to_toml(resolved))
    assert read_config(printed) == resolved
    assert resolved.sampling.guidance_scale == 4.5 and resolved.lora.targets


def test_overrides_apply_and_parse_toml_values(tmp_path: pathlib.Path) -> None:
    path = write_config(tmp_path / "a.toml", tiny_table(tmp_path, "sd35"))
    config = read_config(
        path,
        [
            "training.learning_rate=1e-5",
            "sampling.shared_noise=true",
            "lora.targets=['attn.to_q']",
            "pipeline.path=/elsewhere/sd35",
            "algorithm.flow_grpo.beta=0.01",
        ],
    )
    assert config.training.learning_rate == 1e-5 and config.sampling.shared_noise
    assert config.lora.targets == ("attn.to_q",) and config.pipeline.path == "/elsewhere/sd35"
    assert config.algorithm_table.beta == 0.01  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(ALGORITHM_TABLES))
def test_every_algorithm_has_its_own_table(tmp_path: pathlib.Path, name: str) -> None:
    shift = {"time_shift": 3.0} if "flash" in name else {}
    config = config_from_table(tiny_table(tmp_path, "sd35", algorithm=name, sampling=shift))
    assert config.algorithm.name == name
    printed = config_to_toml(config.resolved())
    assert f"[algorithm.{name}]" in printed


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.learnin_rate=1", "unknown setting `training.learnin_rate`. Did you mean "
         "`training.learning_rate`?"),
        ("sampling.gruop_size=4", "Did you mean `sampling.group_size`?"),
        ("traning.epochs=3", "unknown section or setting `traning`. Did you mean `training`?"),
        ("algorithm.dppo.kl_threshold=0.5", "[algorithm.dppo] is read only by algorithm 'dppo'"),
        ("algorithm.flow_grpo.kl_threshold=0.5", "It is read by 'dppo'"),
        ("reward.pickscore.url='http://x'", "does not read `reward.pickscore.url` (read by kind "
         "'http')"),
        ("sampling.group_size=1", "Setting `sampling.group_size` must be an int >= 2"),
        ("training.updates_per_epoch=3", "`training.updates_per_epoch`=3 must divide"),
        ("lora.init='orthogonal'", "Setting `lora.init` must be one of"),
        ("seed=-1", "Setting `seed` must be an int in 0.."),
        ("pipeline.random_weights='sd3.5-medium'", "`pipeline.path` or `random_weights` must "
         "be given"),
        ("sampling.height=512", "`sampling.resolution` excludes `height` and `width`"),
        ("algorithm.name='mixgrpo-flash'", "`sampling.time_shift` must be given with "
         "`algorithm.mixgrpo-flash.compress_ratio`"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_named(tmp_path: pathlib.Path, override: str, message: str) -> None:
    path = write_config(tmp_path / "a.toml", tiny_table(tmp_path, "sd35"))
    with pytest.raises(ConfigError) as caught:
        read_config(path, [override])
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_config_without_reward_or_pipeline_is_refused(tmp_path: pathlib.Path) -> None:
    table = tiny_table(tmp_path, "sd35", rewards={})
    with pytest.raises(ConfigError, match=r"no reward: add a table \[reward.<name>\]"):
        config_from_table(table)
    del table["pipeline"]
    with pytest.raises(ConfigError, match=r"no \[pipeline\] section"):
        config_from_table(table)


def test_a_file_that_is_not_toml_names_its_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[pipeline]\npath = \n")
    with pytest.raises(ConfigError, match=r"bad.toml is not valid TOML: .*line 2"):
        read_config(path)
    with pytest.raises(ConfigError, match=r"must be section.key=value"):
        apply_override({}, "no-equals-sign")
