"""`python -m bench.flash_ablation VARIANT --out DIR [--star] [--seed S] [--epochs E]`:
MixGRPO-Flash's (or with `--star` MixGRPO-Flash*'s) rollout with one thing changed
(docs/recipes.md, the paragraphs on MixGRPO-Flash's collapse).

Trains the demo's `--algorithm mixgrpo-flash` (the released window, the model's time in
thousandths, 26 points; `--star`: `mixgrpo-flash-star`, 23 points) with the ODE part after the
window or the grid changed:

- `released`: DPM-Solver++(2M) on the rest of the grid compressed by 0.4 (Flash*: 0.2), as
    `--algorithm` runs it;
- `grid_11`: Flash on 11 points, the demo's former grid, where the compressed rest falls to
    one solver step and then none;
- `dpm_uncompressed`: DPM-Solver++(2M) on the uncompressed rest of 11 points;
- `euler_uncompressed`: Euler on the uncompressed rest of 11 points (MixGRPO's rollout on 11
    points);
- `compress_0_4`: the rest compressed by 0.4 (for Flash*: 7 solver steps after its window,
    where 0.2 leaves 3).

Everything else is the main job's defaults, with a held-out evaluation every 10 epochs; the
run's `metrics.jsonl` in DIR holds the curve.
"""

import argparse
import dataclasses

from flowgrpo_eqx import Euler
from flowgrpo_eqx.shapes_demo import algorithms
from flowgrpo_eqx.shapes_demo.cli import main as command_line


VARIANTS = {
    "released": {},
    "grid_11": dict(rollout_steps=11),
    "dpm_uncompressed": dict(compress_ratio=None, rollout_steps=11),
    "euler_uncompressed": dict(solver=Euler(), compress_ratio=None, rollout_steps=11),
    "compress_0_4": dict(compress_ratio=0.4),
}
"""What each variant changes of the registered MixGRPO-Flash (or Flash*)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flash_ablation", description=__doc__)
    parser.add_argument("variant", choices=tuple(VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--star", action="store_true", help="ablate MixGRPO-Flash* instead")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=100)
    arguments = parser.parse_args(argv)
    name = "mixgrpo-flash-star" if arguments.star else "mixgrpo-flash"
    released = algorithms.ALGORITHMS[name]
    algorithms.ALGORITHMS[name] = dataclasses.replace(released, **VARIANTS[arguments.variant])
    return command_line(
        ["train", "--algorithm", name, "--epochs", str(arguments.epochs)]
        + ["--eval-every", "10", "--seed", str(arguments.seed), "--out", arguments.out]
        + ["--quiet"],
        own_process=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
