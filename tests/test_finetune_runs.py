"""`flowgrpo-eqx finetune` end to end on the tiny pipelines diffusers made in the published
layouts: each model kind fine-tunes two epochs from its folder, a run resumed after its first
epoch ends bit for bit as the uninterrupted one, the adapters and the merged transformer are
exported and read back, and each reward kind scores."""

import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from flowgrpo_eqx.finetune import read_config, run_finetune
from flowgrpo_eqx.models import load_diffusers

from .cli_helpers import compilation_cache, run_process
from .diffusers_helpers import WEIGHTS, assert_merged_is_base_plus_adapters
from .finetune_helpers import PICKSCORE, PROCESSOR, tiny_table, write_config


REWARDS: dict[str, dict[str, dict[str, Any]]] = {
    "sd35": {
        "pickscore": {"kind": "pickscore", "model": str(PICKSCORE), "processor": str(PROCESSOR)},
        "bright": {
            "kind": "python",
            "weight": 0.5,
            "function": "tests.finetune_rewards:brightness_and_prompt",
        },
    },
    "flux_dev": {
        "clip": {"kind": "clipscore", "model": str(PICKSCORE), "processor": str(PROCESSOR)}
    },
    "flux_schnell": {
        "bright": {"kind": "python", "function": "tests.finetune_rewards:brightness_and_prompt"}
    },
    "wan": {
        "pickscore": {"kind": "pickscore", "model": str(PICKSCORE), "processor": str(PROCESSOR)}
    },
}
"""Each kind's reward: device (PickScore, CLIP score; on Wan's videos, frame by frame), host
(a Python function reading the prompts and their metadata) and their weighted sum."""


def _run(config_path: pathlib.Path, out: pathlib.Path, **flags: Any) -> dict[str, Any]:
    with compilation_cache():
        return run_finetune(read_config(config_path), out, quiet=True, log=lambda _: None, **flags)


def _adapters(out: pathlib.Path) -> dict[str, np.ndarray]:
    return load_file(str(out / "lora" / "pytorch_lora_weights.safetensors"))


@pytest.mark.parametrize("kind", ["sd35", "flux_dev", "flux_schnell", "wan"])
def test_a_kind_finetunes_resumes_and_exports(tmp_path: pathlib.Path, kind: str) -> None:
    config = write_config(tmp_path / "run.toml", tiny_table(tmp_path, kind, rewards=REWARDS[kind]))
    whole = tmp_path / "whole"
    summary = _run(config, whole)
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1, 2]
    for name in REWARDS[kind]:
        assert all(np.isfinite(r[f"heldout_{name}"]) for r in records)
        assert all(np.isfinite(r[f"reward_{name}"]) for r in records[1:])
    assert summary["epochs"] == 2 and np.isfinite(summary["heldout_reward"])
    for picture in ("samples_before.png", "samples_after.png", "previews/epoch_00001.png"):
        assert (whole / picture).stat().st_size > 0
    assert list((whole / "tensorboard").iterdir())
    assert (whole / "embeddings" / "index.json").exists()

    # Stopped after its first epoch (its second checkpoint and outputs gone), then resumed.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "ckpt_00000002")
    for name in ("summary.json", "lora", "transformer", "samples_after.png"):
        path = resumed / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    _run(config, resumed, resume=True)
    ours, theirs = _adapters(whole), _adapters(resumed)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)

    # The export reads back: the merged transformer as diffusers' folder, whose every adapted
    # module is the base's weight plus B A, on the configured targets only.
    pipeline = pathlib.Path(read_config(config).pipeline.path or "")
    modules = assert_merged_is_base_plus_adapters(
        whole / "lora", pipeline / "transformer" / WEIGHTS, whole / "transformer" / WEIGHTS
    )
    targets = read_config(config).resolved().lora.targets or ()
    assert modules and all(any(m.endswith("." + t) for t in targets) for m in modules)
    merged = load_diffusers(whole / "transformer")
    base = load_diffusers(pipeline / "transformer")
    assert jax.tree.structure(merged) == jax.tree.structure(base)


def test_a_weighted_sum_of_device_and_host_rewards_is_what_the_run_records(
    tmp_path: pathlib.Path,
) -> None:
    """With `normalize_each`, each term's advantages are normalised in its group; the run's
    recorded reward is the weighted sum of its terms' records."""
    table = tiny_table(
        tmp_path,
        "sd35",
        rewards=REWARDS["sd35"],
        sampling={"reward_combination": "normalize_each"},
        training={"epochs": 1},
    )
    out = tmp_path / "run"
    _run(write_config(tmp_path / "run.toml", table), out)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    expected = record["reward_pickscore"] + 0.5 * record["reward_bright"]
    assert record["reward_mean"] == pytest.approx(expected, rel=1e-6)
    held = record["heldout_pickscore"] + 0.5 * record["heldout_bright"]
    assert record["heldout_reward"] == pytest.approx(held, rel=1e-6)


@pytest.mark.sockets("starts the reward server and calls it over HTTP")
def test_an_http_reward_scores_through_the_reward_server(tmp_path: pathlib.Path) -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowgrpo_eqx.rewards.server",
            "tests.finetune_rewards:brightness_and_prompt",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = line.split("http://", 1)[1].split()[0].rstrip(".")
        table = tiny_table(
            tmp_path,
            "flux_schnell",
            rewards={"served": {"kind": "http", "url": f"http://{url}"}},
            training={"epochs": 1},
        )
        out = tmp_path / "run"
        _run(write_config(tmp_path / "run.toml", table), out)
    finally:
        server.terminate()
        server.wait(timeout=30)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(record["reward_served"]) and np.isfinite(record["heldout_served"])


def test_export_writes_any_checkpoint(tmp_path: pathlib.Path) -> None:
    from flowgrpo_eqx.finetune import export_checkpoint

    table = tiny_table(tmp_path, "sd35", training={"epochs": 1, "ema": False})
    config = write_config(tmp_path / "run.toml", table)
    out = tmp_path / "run"
    _run(config, out)
    with compilation_cache():
        written = export_checkpoint(out, "ckpt_00000001", tmp_path / "exported")
    assert [p.name for p in written] == ["lora", "transformer"]
    ours, final = _adapters(tmp_path / "exported"), _adapters(out)
    for key in final:
        np.testing.assert_array_equal(ours[key], final[key])


@pytest.mark.several_processes("runs flowgrpo-eqx finetune as two processes")
@pytest.mark.sockets("the processes' coordinator listens on a loopback port")
def test_two_processes_train_as_one(tmp_path: pathlib.Path) -> None:
    """`flowgrpo-eqx launch --local 2 -- finetune ...` splits each rollout and update over two
    processes on `jax.distributed` (the host reward on process 0), and ends where one process
    ends, to float rounding."""
    table = tiny_table(
        tmp_path,
        "sd35",
        rewards=REWARDS["sd35"],
        training={"epochs": 1},
        evaluation={"before": False},
    )
    one = tmp_path / "one"
    _run(write_config(tmp_path / "one.toml", table), one)
    # The same calls of 4 samples and microbatches of 2, each cut over the two processes.
    table["sampling"]["batch"], table["training"]["batch"] = 2, 1
    config = write_config(tmp_path / "two.toml", table)
    two = tmp_path / "two"
    result = run_process("launch", "--local", "2", "--", "finetune", str(config), "--out",
                         str(two), "--quiet")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours, theirs = _adapters(one), _adapters(two)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_allclose(theirs[key], ours[key], rtol=1e-4, atol=1e-6, err_msg=key)
    first = json.loads((two / "metrics.jsonl").read_text().splitlines()[-1])
    alone = json.loads((one / "metrics.jsonl").read_text().splitlines()[-1])
    assert first["reward_mean"] == pytest.approx(alone["reward_mean"], rel=1e-4)


ALGORITHM_SETTINGS: dict[str, dict[str, Any]] = {
    "flow_grpo": {},
    "nft": {},
    "awm": {"train_timesteps": 2},
    "dgpo": {"train_timesteps": 2, "trunc_steps": 2},
    "mixgrpo": {"window": 2},
    "mixgrpo-flash": {"window": 2},
    "mixgrpo-flash-star": {"window": 2},
    "dppo": {},
    "dancegrpo": {},
}
"""Each algorithm's table, cut to the tiny grid of 4 steps."""


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_SETTINGS))
def test_each_algorithm_trains_an_epoch(tmp_path: pathlib.Path, algorithm: str) -> None:
    """Every algorithm's objective and sampler, built from its table, trains an epoch of the
    tiny SD3.5 pipeline through the command's loop and exports."""
    table = tiny_table(
        tmp_path,
        "sd35",
        algorithm=algorithm,
        algorithm_table=ALGORITHM_SETTINGS[algorithm],
        sampling={
            "train_steps": 4,
            "eval_steps": 2,
            **({"time_shift": 3.0} if "flash" in algorithm else {}),
        },
        training={"epochs": 1},
        evaluation={"before": False},
    )
    out = tmp_path / "run"
    summary = _run(write_config(tmp_path / "run.toml", table), out)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(record["loss"]) and np.isfinite(summary["heldout_reward"])
    assert (out / "lora" / "pytorch_lora_weights.safetensors").exists()
