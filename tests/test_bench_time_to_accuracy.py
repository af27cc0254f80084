"""`bench.time_to_accuracy` reads run folders as the main job writes them: the held-out curve
against the epochs' own seconds, the first evaluation past each threshold, the phases."""

import json

import pytest

from bench import time_to_accuracy as tta


def write_run(folder, accuracies, *, sampling=0.25, reward=0.01, update=0.5, first=5.0):
    """A run folder of `len(accuracies) - 1` epochs, measured at epoch 0 and every other."""
    folder.mkdir(parents=True)
    records = [{"epoch": 0, "heldout_accuracy": accuracies[0]}]
    for epoch in range(1, len(accuracies)):
        record = {
            "epoch": epoch,
            "seconds_sampling": first if epoch == 1 else sampling,
            "seconds_reward": reward,
            "seconds_update": update,
        }
        if epoch % 2 == 0:
            record.update(heldout_accuracy=accuracies[epoch], seconds_evaluation=0.8)
        records.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "final_accuracy": accuracies[-1],
        "final_diversity": 0.5,
        "base_diversity": 0.6,
        "wall_seconds": 12.0,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_curve_counts_only_the_epochs_own_seconds(tmp_path):
    run = tta.curve(write_run(tmp_path / "run", [0.6, 0.7, 0.86, 0.8, 0.91]))
    assert run["epochs"] == [0, 2, 4]
    assert run["accuracy"] == [0.6, 0.86, 0.91]
    # Epoch 1 compiles (5 s of sampling); evaluation seconds are left out.
    assert run["seconds"] == pytest.approx([0.0, 5.51 + 0.76, 5.51 + 3 * 0.76])
    assert tta.first_reaching(run, 0.85) == (2, pytest.approx(6.27))
    assert tta.first_reaching(run, 0.90) == (4, pytest.approx(7.79))
    assert tta.first_reaching(run, 0.95) is None
    phases = run["phases"]
    assert phases["seconds_sampling"] == pytest.approx(0.25)
    assert phases["seconds_evaluation"] == pytest.approx(0.8)
    assert phases["first_epoch"] == pytest.approx(5.51)
    assert phases["evaluations"] == 2


def test_the_table_says_how_many_seeds_reach_each_threshold(tmp_path):
    runs = [
        tta.curve(write_run(tmp_path / "a", [0.6, 0.7, 0.86, 0.8, 0.91])),
        tta.curve(write_run(tmp_path / "b", [0.6, 0.7, 0.80, 0.8, 0.87])),
    ]
    table = tta.table({"flow_grpo": runs})
    row = table.splitlines()[2]
    assert "| 3 ± 1 | 7 ± 1 s |" in row  # 0.85: both seeds, at epochs 2 and 4
    assert "| 4 (1 of 2) | 8 (1 of 2) s |" in row  # 0.90: one seed of two
    assert "0.890 ± 0.020 (worst 0.870)" in row
    assert "0.833 ± 0.000 (lowest 0.833)" in row
    assert "Flow-GRPO, the main job's defaults" in tta.phase_table({"flow_grpo": runs})
