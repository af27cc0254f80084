"""How people drive a run: a reward server, metrics in TensorBoard, config files, seeds.

Every run here is `flowgrpo-eqx` on the tiny preset, run in the test process (`cli.main`) on
the session's tiny base model; reward servers are real `flowgrpo-eqx serve-reward` processes on
127.0.0.1 (one is killed mid-run; tests/test_distributed.py has two processes share one).
"""

import json
import shutil
import threading
import time
import typing

import equinox as eqx
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import cli as cli_module, make_config
from flowgrpo_eqx.shapes_demo.algorithms import ALGORITHMS
from flowgrpo_eqx.shapes_demo.config import SETTINGS, config_to_toml
from flowgrpo_eqx.shapes_demo.job import ShapesJob
from flowgrpo_eqx.shapes_demo.parts import measures_train_reward
from flowgrpo_eqx.shapes_demo.settings import AlgorithmName
from flowgrpo_eqx.train import MetricsLog, _checkpoint
from tests.cli_helpers import (
    RewardServer,
    metrics_of,
    result_of,
    run_cli,
    with_base,
)


COMMON = ["--preset", "tiny", "--quiet", "--seed", "6"]


def cli(*args, **extra_env):
    return run_cli(*args, **extra_env)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, tiny_base):
    out = with_base(tiny_base, tmp_path_factory.mktemp("in_process"))
    result = cli("train", *COMMON, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    # What the run printed, for the tests that read it.
    (out / "printed.txt").write_text(result.stdout)
    return out


def test_the_tiny_run_reports_held_out_figures_that_move(in_process):
    summary = json.loads((in_process / "summary.json").read_text())
    # A width-16 model pretrained for 20 steps draws no shape, so accuracy and the checker's
    # score stay 0; the run's own reward (JPEG incompressibility) on the held-out samples and
    # their diversity (two samples per prompt) are measured, and training moves them.
    assert summary["final_accuracy"] == summary["base_accuracy"] == 0.0
    base, final = summary["base_heldout_train_reward"], summary["final_heldout_train_reward"]
    assert base > 0 and final > 0 and final != base
    assert summary["base_diversity"] > 0 and summary["final_diversity"] != summary["base_diversity"]
    records = MetricsLog(in_process / "metrics.jsonl").read()
    measured = [r["epoch"] for r in records if "heldout_train_reward" in r]
    assert measured == [r["epoch"] for r in records if "heldout_accuracy" in r] == [0, 2, 4]
    printed = (in_process / "printed.txt").read_text()
    assert f"held-out jpeg_incompressibility {final:.3f} (base {base:.3f})." in printed


@pytest.mark.parametrize(
    "settings, measured",
    [
        ({}, False),
        ({"reward": "partial"}, False),
        ({"reward": "jpeg_incompressibility"}, True),
        ({"reward_weights": "partial=1,jpeg_incompressibility=0.5"}, True),
        ({"reward_url": "http://127.0.0.1:1"}, True),
        ({"custom_reward": "tests.cli_rewards:brightness"}, False),
    ],
)
def test_the_held_out_measure_scores_with_the_train_reward_but_the_checkers_or_the_users(
    settings, measured
):
    # The main job's default (the checker's partial and strict scores) is measured anyway; a
    # reward server is asked (as for the rollouts), the user's own reward is never called.
    if "reward_weights" not in settings and settings:
        settings = {**settings, "reward_weights": None, "reward_combination": "sum"}
    assert measures_train_reward(make_config(**settings).rewards) is measured


def test_every_epoch_says_where_its_time_went(in_process):
    epochs = [r for r in MetricsLog(in_process / "metrics.jsonl").read() if r["epoch"] >= 1]
    assert epochs
    for record in epochs:
        assert record["seconds_sampling"] > 0 and record["seconds_update"] > 0
        assert record["seconds_reward"] >= 0
        # Only an epoch with a held-out measure spent time on one.
        assert ("seconds_evaluation" in record) == ("heldout_accuracy" in record)
    elapsed = [r["seconds_elapsed"] for r in epochs]
    assert elapsed == sorted(elapsed)
    phases = ("seconds_sampling", "seconds_reward", "seconds_update", "seconds_evaluation")
    assert elapsed[-1] >= sum(r.get(phase, 0.0) for r in epochs for phase in phases)


@pytest.mark.several_processes("serves a reward from a flowgrpo-eqx process")
@pytest.mark.sockets("trains through a reward server over HTTP")
def test_training_through_a_reward_server_matches_in_process(in_process, tmp_path):
    server = RewardServer("jpeg_incompressibility")
    try:
        out = with_base(in_process, tmp_path / "served")
        result = cli("train", *COMMON, "--out", str(out), "--reward-url", server.url)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result_of(out) == result_of(in_process)
    assert (out / "policy.eqx").read_bytes() == (in_process / "policy.eqx").read_bytes()
    # The held-out train reward too: the run through the server wrote null for both.
    served, local = (json.loads((f / "summary.json").read_text()) for f in (out, in_process))
    for name in ("base_heldout_train_reward", "final_heldout_train_reward"):
        assert served[name] == local[name] and local[name] is not None
    heldout = [
        [r.get("heldout_train_reward") for r in MetricsLog(f / "metrics.jsonl").read()]
        for f in (out, in_process)
    ]
    assert heldout[0] == heldout[1]


@pytest.mark.several_processes("serves a reward from a flowgrpo-eqx process")
@pytest.mark.sockets("trains through a reward server over HTTP")
def test_server_killed_mid_run_is_a_named_error_and_resume_finishes(in_process, tmp_path):
    out = with_base(in_process, tmp_path / "outage")
    server = RewardServer("jpeg_incompressibility")
    options = ["--reward-timeout", "2", "--reward-retries", "1"]
    metrics = out / "metrics.jsonl"
    run_over = threading.Event()

    def kill_after_the_first_epoch():
        # The run goes on in this process; the server dies once epoch 1 is logged.
        while not run_over.is_set() and not any(
            r.get("epoch", 0) >= 1 for r in (MetricsLog(metrics).read() if metrics.exists() else [])
        ):
            time.sleep(0.01)
        server.process.kill()

    killer = threading.Thread(target=kill_after_the_first_epoch)
    killer.start()
    try:
        run = cli("train", *COMMON, *options, "--out", str(out), "--reward-url", server.url)
    finally:
        run_over.set()
        killer.join()
    server.stop()
    err = run.stderr
    assert run.returncode == 1, err[-3000:]
    assert f"flowgrpo-eqx: error on process 0: Reward 'http:{server.url}'" in err
    assert server.url in err and "Traceback" not in err
    restarted = RewardServer("jpeg_incompressibility")
    try:
        resumed = cli(
            "train", *COMMON, *options, "--out", str(out), "--reward-url", restarted.url,
            "--resume",
        )  # fmt: skip
    finally:
        restarted.stop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert result_of(out) == result_of(in_process)
    assert (out / "policy.eqx").read_bytes() == (in_process / "policy.eqx").read_bytes()


def test_tensorboard_log_holds_scalars_images_and_histograms(in_process, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    out = with_base(in_process, tmp_path / "watched")
    result = cli("train", *COMMON, "--out", str(out), "--log", "tensorboard")
    assert result.returncode == 0, result.stderr[-3000:]
    events = event_accumulator.EventAccumulator(
        str(out / "tensorboard"),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.IMAGES: 0,
            event_accumulator.HISTOGRAMS: 0,
        },
    )
    events.Reload()
    tags = events.Tags()
    records = MetricsLog(out / "metrics.jsonl").read()
    rewards = events.Scalars("reward_mean")
    assert [e.step for e in rewards] == [r["epoch"] for r in records if "reward_mean" in r]
    np.testing.assert_allclose(
        [e.value for e in rewards],
        [r["reward_mean"] for r in records if "reward_mean" in r],
        rtol=1e-6,
    )
    assert "heldout_accuracy" in tags["scalars"]
    assert "heldout_samples" in tags["images"]
    assert {"advantages", "policy_ratio"} <= set(tags["histograms"])
    advantages = events.Histograms("advantages")
    assert len(advantages) == make_config("tiny").training.epochs
    # Group-normalised advantages: as many as rows, summing to ~0.
    assert advantages[0].histogram_value.num == make_config("tiny").rollout.rollout_rows
    assert abs(advantages[0].histogram_value.sum) < 1e-3


def test_config_file_round_trip_and_precedence(in_process, tmp_path):
    saved = in_process / "config.toml"
    # The run folder's config.toml reproduces the run's configuration exactly.
    printed = cli("train", "--config", str(saved), "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == saved.read_text()
    assert printed.stdout == config_to_toml(make_config("tiny", seed=6))
    # preset < file < flags
    partial = tmp_path / "run.toml"
    partial.write_text('epochs = 9\nlearning_rate = 3e-4\nlog = ["tensorboard"]\n')
    resolved = cli("train", "--preset", "tiny", "--config", str(partial), "--epochs", "5",
                   "--print-config")  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    lines = set(resolved.stdout.splitlines())
    assert {"epochs = 5", "learning_rate = 0.0003", 'log = ["tensorboard"]', "width = 16"} <= lines


@pytest.mark.parametrize(
    "text, named",
    [
        ("epochs = 3\nwidht = 8\n", "unknown setting 'widht'"),
        ('epochs = "three"\n', "setting 'epochs' = 'three' is not of type"),
        ("learning_rate = true\n", "setting 'learning_rate' = True is not of type"),
        ('reward = "clip"\n', "setting 'reward' = 'clip' is not of type"),
        ("epochs = [\n", "Config file"),
    ],
)
def test_config_file_errors_name_the_key_and_file(tmp_path, text, named):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = cli("train", "--config", str(path), "--print-config")
    assert result.returncode == 2
    assert named in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_file_that_is_not_utf8_text_is_named(in_process, tmp_path):
    """A binary config.toml gave "'utf-8' codec can't decode byte 0xf1 ...", naming no file."""
    path = tmp_path / "bad.toml"
    path.write_bytes(b"width = 16\n\xf1\xf2 = 3\n")
    result = cli("train", "--config", str(path), "--print-config")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"Config file {str(path)!r} is not UTF-8 text (byte(s) 0xf1 at offset 11)" in line
    # A run folder's own config.toml, as eval reads it.
    run = tmp_path / "run"
    shutil.copytree(in_process, run)
    (run / "config.toml").write_bytes(b"\xff\xfe" + (in_process / "config.toml").read_bytes())
    result = cli("eval", "--run", run, "--quiet", "--out", tmp_path / "eval")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"Config file {str(run / 'config.toml')!r} is not UTF-8 text" in line


def test_eval_reads_the_run_folders_settings(in_process, tmp_path):
    summary = json.loads((in_process / "summary.json").read_text())
    final = {name: summary[f"final_{name}"] for name in ("accuracy", "reward", "diversity")}
    final["train_reward"] = summary["final_heldout_train_reward"]
    last = sorted((in_process / "checkpoints").glob("ckpt_*"))[-1]
    # No settings flag: `--run` (its policy.eqx), or a policy or checkpoint inside the run,
    # is measured with the run's config.toml, as the run measured its final policy.
    for index, target in enumerate(
        [("--run", in_process), ("--checkpoint", in_process / "policy.eqx"), ("--checkpoint", last)]
    ):
        result = cli("eval", *target, "--quiet", "--out", tmp_path / f"eval_{index}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"Settings from {in_process / 'config.toml'}." in result.stdout
        assert json.loads(result.stdout.splitlines()[-1]) == final


@pytest.mark.parametrize("when", ["before the read", "during the read"])
def test_eval_of_a_run_still_training_measures_its_newest_checkpoint(
    in_process, tmp_path, monkeypatch, when
):
    """`eval --run` on a run still training failed 3 times in 3, with `[Errno 2] No such file
    or directory: ... ckpt_000000NN` or naming the checkpoint as not fitting the model: the
    run pruned the checkpoint eval had chosen while eval read it."""
    run = tmp_path / "training"
    shutil.copytree(in_process, run)
    for name in ("policy.eqx", "summary.json"):
        (run / name).unlink()
    checkpoints = run / "checkpoints"
    chosen = sorted(checkpoints.glob("ckpt_*"))[-1]
    following = checkpoints / f"ckpt_{int(chosen.name[len('ckpt_') :]) + 1:08d}"
    direct = cli("eval", "--checkpoint", chosen, "--quiet", "--out", tmp_path / "direct")
    assert direct.returncode == 0, direct.stderr[-3000:]

    def the_run_goes_on():
        # It writes its next checkpoint (here the same state), then prunes the oldest kept.
        shutil.copytree(chosen, following)
        shutil.rmtree(chosen)

    if when == "before the read":
        resolve = cli_module.eval_target

        def resolved_then_pruned(*args):
            target = resolve(*args)
            the_run_goes_on()
            return target

        monkeypatch.setattr(cli_module, "eval_target", resolved_then_pruned)
    else:
        check = _checkpoint.check_state_files

        def pruned_while_read(folder, metadata):
            if folder == chosen:
                the_run_goes_on()
            return check(folder, metadata)

        monkeypatch.setattr(_checkpoint, "check_state_files", pruned_while_read)
    result = cli("eval", "--run", run, "--quiet", "--out", tmp_path / "eval")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"{chosen.name} was pruned by the run (still training) while it was read; measuring "
        f"its newest checkpoint, {following.name}." in result.stdout
    )
    assert json.loads(result.stdout.splitlines()[-1]) == json.loads(direct.stdout.splitlines()[-1])


def test_eval_of_a_named_checkpoint_removed_while_read_says_so(in_process, tmp_path, monkeypatch):
    """A checkpoint named on its own is not swapped for another when its run prunes it."""
    copy = tmp_path / "training"
    shutil.copytree(in_process, copy)
    chosen = sorted((copy / "checkpoints").glob("ckpt_*"))[-1]
    check = _checkpoint.check_state_files

    def pruned_while_read(folder, metadata):
        shutil.rmtree(folder)
        return check(folder, metadata)

    monkeypatch.setattr(_checkpoint, "check_state_files", pruned_while_read)
    result = cli("eval", "--checkpoint", chosen, "--quiet", "--out", tmp_path / "eval")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert f"{chosen} was removed while it was read: the run that wrote it is still" in line
    assert "--run RUN_FOLDER" in line and "does not fit" not in line


def test_eval_names_checkpoints_and_the_settings_that_do_not_fit(in_process, tmp_path):
    folder = in_process / "checkpoints"
    listed = cli("eval", "--checkpoint", folder, "--out", tmp_path / "a")
    assert listed.returncode == 2
    assert "is a folder of checkpoints; name one of them:" in listed.stderr
    for checkpoint in folder.glob("ckpt_*"):
        assert str(checkpoint) in listed.stderr
    # A policy outside its run folder, read with the default preset's model settings.
    alone = tmp_path / "policy.eqx"
    alone.write_bytes((in_process / "policy.eqx").read_bytes())
    result = cli("eval", "--checkpoint", alone, "--out", tmp_path / "b")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert f"{alone} does not fit the model settings width=64, depth=4" in line
    assert "--run RUN_FOLDER" in line and "--preset tiny" in line
    assert "TreePathError" not in line and "EOFError" not in line
    # Given the settings as a flag, it is measured.
    fitted = cli("eval", "--checkpoint", alone, "--preset", "tiny", "--out", tmp_path / "c")
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    neither = cli("eval", "--out", tmp_path / "d")
    assert neither.returncode == 2 and "--run RUN_FOLDER" in neither.stderr


def test_training_seeds_share_the_base_and_differ_only_in_the_run(in_process, tmp_path):
    again = with_base(in_process, tmp_path / "again")
    other = with_base(in_process, tmp_path / "other")
    same = cli("train", *COMMON, "--out", str(again))
    changed = cli("train", *COMMON, "--seed", "7", "--out", str(other))
    assert same.returncode == 0 and changed.returncode == 0, same.stderr + changed.stderr
    base = next(in_process.glob("base_*.eqx")).name
    for folder in (again, other):
        summary = json.loads((folder / "summary.json").read_text())
        # The base model was loaded (not pretrained again) from the same file name.
        assert summary["base_source"] == str(folder / base)
    # The same --seed reproduces the run bit for bit ...
    assert (again / "policy.eqx").read_bytes() == (in_process / "policy.eqx").read_bytes()
    assert metrics_of(again) == metrics_of(in_process)
    # ... another --seed keeps the base model and its measurement, but not the rollouts.
    first = result_of(in_process)
    second = result_of(other)
    assert second["base_accuracy"] == first["base_accuracy"]
    assert second["base_diversity"] == first["base_diversity"]
    assert second["train_reward_first_epoch"] != first["train_reward_first_epoch"]


def test_recipe_options_reach_the_run_and_its_saved_configuration(in_process, tmp_path):
    out = with_base(in_process, tmp_path / "sliding")
    flags = ["--window-schedule", "sliding", "--window-shift-every", "1", "--shared-noise", "true",
             "--grpo-guard", "true", "--reward-combination", "normalize_each",
             "--reward-weights", "jpeg_incompressibility=1,partial=0.5",
             "--precision", "bfloat16", "--old-log-probs", "update"]  # fmt: skip
    result = cli("train", *COMMON, *flags, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in MetricsLog(out / "metrics.jsonl").read() if "window_start" in r]
    # The tiny preset: 3 transitions, a window of sde_steps = 2 moving one step per epoch.
    assert [r["window_start"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    # GRPO-Guard's per-step ratios are logged for each recorded transition.
    assert all(
        {"step_ratios/raw_mean/0", "step_ratios/normalised_std/1"} <= set(r) for r in records
    )
    saved = set((out / "config.toml").read_text().splitlines())
    assert {
        'window_schedule = "sliding"',
        "window_shift_every = 1",
        "shared_noise = true",
        "grpo_guard = true",
        'reward_combination = "normalize_each"',
        'reward_weights = "jpeg_incompressibility=1,partial=0.5"',
        'precision = "bfloat16"',
        'old_log_probs = "update"',
    } <= saved


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, "rollout"),
        ({"precision": "bfloat16"}, "update"),
        ({"precision": "bfloat16", "old_log_probs": "rollout"}, "rollout"),
        ({"old_log_probs": "update"}, "update"),
        ({"precision": "bfloat16", "algorithm": "nft"}, "rollout"),
    ],
)
def test_old_log_probs_default_to_the_update_program_in_bfloat16(settings, expected, tmp_path):
    job = ShapesJob(make_config("tiny", **settings), tmp_path, True)
    assert job.flow_grpo_objective(job.model).old_log_probs == expected


@pytest.mark.parametrize(
    "algorithm, kind",
    [
        ("flow_grpo", fg.FlowGRPOObjective),
        ("nft", fg.DiffusionNFTObjective),
        ("awm", fg.AWMObjective),
        ("dgpo", fg.DGPOObjective),
        ("mixgrpo", fg.FlowGRPOObjective),
        ("dppo", fg.FlowDPPOObjective),
    ],
)
def test_the_jobs_objective_is_its_algorithms(algorithm, kind, tmp_path):
    job = ShapesJob(make_config("tiny", algorithm=algorithm), tmp_path, True)
    objective = job.objective(job.model)
    assert type(objective) is kind
    assert eqx.tree_equal(objective, job.algorithm.objective(job.pieces(), job.model))
    # Flow-GRPO's objective, whatever the algorithm: what `check` checks and ratios rescore with.
    assert isinstance(job.flow_grpo_objective(job.model), fg.FlowGRPOObjective)


def test_the_algorithm_names_come_from_the_registry():
    names = tuple(ALGORITHMS)
    assert typing.get_args(AlgorithmName) == names
    assert SETTINGS["algorithm"].choices == names
    parser = cli_module.build_parser()
    for name in names:
        assert parser.parse_args(["train", "--algorithm", name]).algorithm == name
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--algorithm", "grpo"])


def test_nft_turns_the_default_shared_noise_off():
    assert make_config("default").rollout.shared_noise
    assert not make_config("default", algorithm="nft").rollout.shared_noise
    assert make_config("default", algorithm="flow_grpo").rollout.shared_noise


@pytest.mark.parametrize(
    "settings, weights, combination",
    [
        ({}, "partial=1,strict=1", "normalize_each"),
        ({"reward": "strict"}, None, "sum"),
        ({"custom_reward": "tests.cli_rewards:brightness"}, None, "sum"),
        ({"reward_url": "http://127.0.0.1:1"}, None, "sum"),
        (
            {"reward": "strict", "reward_combination": "sum", "reward_weights": "strict=1"},
            "strict=1",
            "sum",
        ),
    ],
)
def test_choosing_one_reward_turns_the_default_weighted_sum_off(settings, weights, combination):
    config = make_config("default", **settings)
    reward = config.rewards
    assert (reward.reward_weights, reward.reward_combination) == (weights, combination)
    # A saved configuration names every setting, so reading it back changes nothing.
    assert make_config("default", **config.settings()) == config


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--shared-noise", "maybe"], "--shared-noise"),
        (["--window-schedule", "wrap"], "--window-schedule"),
        (["--window-schedule", "random", "--train-steps", "1"], "train_steps"),
        (["--window-schedule", "sliding", "--window-shift-every", "0"], "window_shift_every"),
        (["--grpo-guard", "perhaps"], "--grpo-guard"),
        (["--reward-weights", "partial=1,sharpness=2"], "reward_weights"),
        (["--reward-weights", "partial=heavy"], "reward_weights"),
        (["--reward-combination", "normalize_each"], "reward_combination"),
        (["--precision", "float16"], "--precision"),
        (["--param-sharding", "zero3"], "--param-sharding"),
        (["--old-log-probs", "recorded"], "--old-log-probs"),
        (["--algorithm", "nft", "--shared-noise", "true"], "shared_noise"),
    ],
)
def test_bad_recipe_options_are_named(flags, named):
    result = cli("train", "--preset", "tiny", *flags, "--print-config")
    assert result.returncode == 2
    assert named in result.stderr and "Traceback" not in result.stderr
