"""`python -m bench.precision`: how far the first update's policy ratio is from 1, float32 vs
bfloat16, on the shapes demo (its shipped base model, one rollout of the main job's size).

For each precision, one rollout of 16 prompts x 16 samples is collected with the shipped
base model, and one `Trainer.update` runs on its first minibatch of 64 rows (the main job's
first update). Before that update the policy is the one that sampled, so its ratio
`exp(log p_theta - old_log_prob)` would be exactly 1 in exact arithmetic: the update's
metrics give its mean, its root-mean-square log (`sqrt(2 approx_kl)`) and the clipped
fraction. Prints one JSON object.
"""

import glob
import json
import math
import pathlib
import tempfile

import jax

from flowgrpo_eqx.shapes_demo import make_config
from flowgrpo_eqx.shapes_demo.job import ShapesJob
from flowgrpo_eqx.train import load_model, minibatches


def _first_update(job, objective, variables, minibatch) -> dict[str, float]:
    """The ratio statistics of one `Trainer.update` on `minibatch` from `variables`."""
    trainer = job.trainer(objective)
    state = trainer.init(jax.random.key(0), variables)
    _, metrics = trainer.update(state, minibatch)
    approx_kl = float(metrics["approx_kl"])
    return {
        "ratio_mean": float(metrics["ratio"]),
        "rms_log_ratio": math.sqrt(2.0 * approx_kl),
        "clipfrac": float(metrics["clipfrac"]),
    }


def main() -> int:
    results = {}
    base_path = sorted(glob.glob(str(pathlib.Path(__file__).parent.parent / "flowgrpo_eqx" /
                                     "shapes_demo" / "checkpoints" / "base_*.eqx")))[0]  # fmt: skip
    for precision in ("float32", "bfloat16"):
        config = make_config("default", precision=precision)
        with tempfile.TemporaryDirectory() as out:
            job = ShapesJob(config, out, True)
            base = load_model(base_path, job.model)
            objective = job.objective(base)
            variables = objective.init(jax.random.key(0))
            rollout = job.rollout(objective)
            key = jax.random.key(1)
            batch, _ = rollout.collect(variables, job.epoch_rows(1), key)
            shuffle = jax.random.key(2)
            rows = config.minibatch_rows or batch.num_rows
            first = next(minibatches(batch, rows, shuffle))
            results[precision] = _first_update(job, objective, variables, first)
    print(json.dumps({"base": pathlib.Path(base_path).name, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
