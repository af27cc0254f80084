"""`bench.accuracy_diversity` reads run folders as the main job writes them: the final held-out
accuracy, the diversity kept over the base model's, and which seeds end inside the goal."""

import json

import pytest

from bench import accuracy_diversity as ad


def write_summary(folder, accuracy, diversity, base_diversity=0.6):
    folder.mkdir(parents=True)
    summary = {
        "final_accuracy": accuracy,
        "final_diversity": diversity,
        "base_diversity": base_diversity,
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_a_run_is_in_the_goal_only_with_both_accuracy_and_diversity(tmp_path):
    run = ad.final(write_summary(tmp_path / "a", 0.96, 0.54))
    assert run == {"accuracy": 0.96, "kept": pytest.approx(0.9)}
    assert ad.in_goal(run)
    assert not ad.in_goal({"accuracy": 0.949, "kept": 0.95})
    assert not ad.in_goal({"accuracy": 0.99, "kept": 0.899})


def test_the_table_gives_each_seed_and_counts_those_in_the_goal(tmp_path):
    runs = [
        ad.final(write_summary(tmp_path / "s0", 0.96, 0.57)),
        ad.final(write_summary(tmp_path / "s1", 0.94, 0.60)),
        ad.final(write_summary(tmp_path / "s2", 0.97, 0.48)),
    ]
    row = ad.table({"small_kl": runs}).splitlines()[2]
    assert row.startswith("| a small KL to the base | `--beta 0.005` |")
    assert "| 0.960, 0.940, 0.970 | 0.957 ± 0.012 (worst 0.940) |" in row
    assert "| 0.95, 1.00, 0.80 | 0.92 ± 0.08 (lowest 0.80) |" in row
    assert row.endswith("| 1 of 3 |")


def test_the_plot_is_drawn(tmp_path):
    runs = [
        ad.final(write_summary(tmp_path / f"s{seed}", 0.9 + seed / 50, 0.55)) for seed in (0, 1)
    ]
    path = tmp_path / "figure" / "accuracy_diversity.png"
    ad.plot({"flow_grpo": runs, "kl": runs}, path)
    assert path.read_bytes().startswith(b"\x89PNG")
