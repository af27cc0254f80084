"""`bench.recipes` measures each option on the base it names: every row's flags give the former
default's settings but for the option itself, so that no row repeats another."""

import tomllib

import pytest

from bench import recipes

from .cli_helpers import run_cli


def settings_of(row):
    result = run_cli("train", *recipes.row_flags(row), "--print-config")
    assert result.returncode == 0, result.stderr
    return tomllib.loads(result.stdout)


@pytest.fixture(scope="module")
def settings():
    return {row: settings_of(row) for row in recipes.ROWS}


def test_the_base_is_the_former_default(settings):
    base = settings["default"]
    want = {"shared_noise": False, "reward": "partial", "reward_weights": "none", "epochs": 200}
    assert {key: base[key] for key in want} == want
    assert base["reward_combination"] == "sum"


@pytest.mark.parametrize(
    "row, changed",
    [
        ("shared_noise", {"shared_noise": True}),
        ("random_window", {"window_schedule": "random"}),
        ("sliding_window", {"window_schedule": "sliding"}),
        ("grpo_guard", {"grpo_guard": True}),
        (
            "normalize_each",
            {"reward_weights": "partial=1,strict=1", "reward_combination": "normalize_each"},
        ),
        ("weighted_sum", {"reward_weights": "partial=1,strict=1"}),
    ],
)
def test_each_option_row_changes_only_its_option(settings, row, changed):
    base, option = settings["default"], settings[row]
    assert {key: value for key, value in option.items() if base.get(key) != value} == changed


def test_the_sliding_window_moves_one_transition_every_20_epochs(settings):
    assert settings["sliding_window"]["window_shift_every"] == 20


def test_the_nft_row_trains_diffusion_nft_on_the_same_base(settings):
    option = settings["nft"]
    assert option["algorithm"] == "nft"
    for key in ("shared_noise", "reward", "reward_weights", "reward_combination", "epochs"):
        assert option[key] == settings["default"][key], key
