"""`python -m bench.checkpoints`: what a checkpoint of the main job's train state costs.

Builds the shapes demo's train state at the main job's settings (the DiT policy and AdamW's
moments; no reference at beta 0), then times, side by side in rounds, one
`Checkpointer.save` (Orbax: shards, `meta.json` with every file's SHA-256, the atomic rename)
and one `eqx.tree_serialise_leaves` of the same state into a single file (the format checkpoints had
before Orbax), on wall clock and on process CPU time, plus one `Checkpointer.restore`. Prints
one JSON object: medians per round, their ratio, and what the main job's epochs with a
checkpoint every `checkpoint_every` epochs add.
"""

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import equinox as eqx
import jax

from flowgrpo_eqx import lora
from flowgrpo_eqx._misc import keys_to_data
from flowgrpo_eqx.shapes_demo import ShapesJob, make_config
from flowgrpo_eqx.train import Checkpointer


ROUNDS = 7


def _timed(action: object) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    action()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.checkpoints", description=__doc__).parse_args(
        argv
    )
    config = make_config()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-checkpoints-"))
    job = ShapesJob(config, folder, quiet=True)
    state = lora.without_bases(job.trainer(job.objective(job.model)).init(jax.random.key(0)))
    arrays = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    checkpoints = Checkpointer(folder / "checkpoints", keep=2)
    checkpoints.save(0, state, {})  # imports Orbax and warms its caches

    def single_file() -> None:
        with open(folder / "state.eqx", "wb") as handle:
            eqx.tree_serialise_leaves(handle, keys_to_data(state))

    rows: dict[str, list[tuple[float, float]]] = {"orbax": [], "single_file": []}
    for step in range(1, ROUNDS + 1):
        print(f"[bench.checkpoints] round {step}/{ROUNDS}", file=sys.stderr, flush=True)
        rows["orbax"].append(_timed(lambda step=step: checkpoints.save(step, state, {})))
        rows["single_file"].append(_timed(single_file))
    restore_wall, restore_cpu = _timed(lambda: checkpoints.restore(state))

    def median(name: str, column: int) -> float:
        return statistics.median(row[column] for row in rows[name])

    saves = config.training.epochs // config.logging.checkpoint_every
    result = {
        "arrays": len(arrays),
        "state_bytes": sum(int(x.nbytes) for x in arrays),
        "rounds": ROUNDS,
        "orbax_save_seconds": median("orbax", 0),
        "orbax_save_cpu_seconds": median("orbax", 1),
        "single_file_seconds": median("single_file", 0),
        "single_file_cpu_seconds": median("single_file", 1),
        "orbax_over_single_file": statistics.median(
            a[0] / b[0] for a, b in zip(rows["orbax"], rows["single_file"], strict=True)
        ),
        "orbax_restore_seconds": restore_wall,
        "orbax_restore_cpu_seconds": restore_cpu,
        "main_job_saves": saves,
        "main_job_added_seconds": saves * (median("orbax", 0) - median("single_file", 0)),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
