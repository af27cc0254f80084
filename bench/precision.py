"""`python -m bench.precision`: how far the first update's policy ratio is from 1, float32 vs
bfloat16, on the shapes demo (its shipped base model, one rollout of the main job's size).

For each precision and each source of the old log densities (`FlowGRPOObjective(old_log_probs=...)`:
as the rollout recorded them, or recomputed by the update's own program), one rollout of
16 prompts x 16 samples is collected with the shipped base model, and one `Trainer.update`
runs on its first minibatch of 64 rows (the main job's first update). Before that update the
policy is the one that sampled, so its ratio `exp(log p_theta - old_log_prob)` would be
exactly 1 in exact arithmetic: the update's metrics give its mean, its root-mean-square log
(`sqrt(2 approx_kl)`) and the clipped fraction. Then each case runs whole epochs of the main
job (`rl_epoch`: rollout, recomputation if any, four updates), one warm-up and
`TIMED_EPOCHS` timed; `epoch_seconds` is their median, and `update_vs_rollout_epoch_time`
the ratio of the two bfloat16 cases' medians, measured side by side in this run. Prints one
JSON object.
"""

import argparse
import glob
import json
import math
import pathlib
import statistics
import tempfile
import time

import jax

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.shapes_demo.job import ShapesJob
from flowgrpo_eqx.train import load_model, minibatch_indices, rl_epoch


TIMED_EPOCHS = 5


def _epoch_seconds(job, trainer, rollout, variables, rows) -> float:
    """The median wall time of `TIMED_EPOCHS` main-job epochs after one warm-up."""
    state = trainer.init(jax.random.key(0), variables)
    times = []
    for epoch in range(1, TIMED_EPOCHS + 2):
        started = time.perf_counter()
        state, _, _ = rl_epoch(
            trainer, state, rollout, job.epoch_rows(epoch), jax.random.key(epoch),
            epoch=epoch, minibatch_rows=rows,
        )  # fmt: skip
        jax.block_until_ready(state)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _first_update(objective, trainer, variables, batch, rows) -> dict[str, float]:
    """The ratio statistics of the first `Trainer.update` of an epoch on `batch`."""
    state = trainer.init(jax.random.key(0), variables)
    first_pass = minibatch_indices(batch.num_rows, rows, jax.random.key(2))
    if objective.old_log_probs == "update":
        request = fg.Rescore(batch, fill=objective.with_rescored_rows)
        batch = trainer.rescore(state, request, first_pass)
    _, metrics = trainer.update(state, jax.tree.map(lambda leaf: leaf[first_pass[0]], batch))
    approx_kl = float(metrics["approx_kl"])
    return {
        "ratio_mean": float(metrics["ratio"]),
        "rms_log_ratio": math.sqrt(2.0 * approx_kl),
        "clipfrac": float(metrics["clipfrac"]),
    }


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.precision", description=__doc__).parse_args(argv)
    results = {}
    base_path = sorted(glob.glob(str(pathlib.Path(__file__).parent.parent / "flowgrpo_eqx" /
                                     "shapes_demo" / "checkpoints" / "base_*.eqx")))[0]  # fmt: skip
    cases = (("float32", "rollout"), ("bfloat16", "rollout"), ("bfloat16", "update"))
    for precision, old_log_probs in cases:
        config = make_config("default", precision=precision, old_log_probs=old_log_probs)
        with tempfile.TemporaryDirectory() as out:
            job = ShapesJob(config, out, True)
            base = load_model(base_path, job.model)
            objective = job.flow_grpo_objective(base)
            variables = objective.init(jax.random.key(0))
            rollout = job.rollout(objective)
            batch, _ = rollout.collect(variables.policy, job.epoch_rows(1), jax.random.key(1))
            trainer = job.trainer(objective)
            assert objective.old_log_probs == old_log_probs
            rows = config.training.minibatch_rows or batch.num_rows
            case = _first_update(objective, trainer, variables, batch, rows)
            case["epoch_seconds"] = _epoch_seconds(job, trainer, rollout, variables, rows)
            results[f"{precision}, old_log_probs={old_log_probs}"] = case
    results["update_vs_rollout_epoch_time"] = (
        results["bfloat16, old_log_probs=update"]["epoch_seconds"]
        / results["bfloat16, old_log_probs=rollout"]["epoch_seconds"]
    )
    print(json.dumps({"base": pathlib.Path(base_path).name, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
