"""`python -m bench.finetune --row ROW [--epochs N]`: `flowgrpo-eqx finetune` at a published
model's size, with random weights (no download), timed by phase.

Each row is a configuration of `pipeline.random_weights` (`ROWS`). The run trains `--epochs`
epochs; the first compiles, the rest are timed. Prints one JSON object: the seconds of an
epoch and of its phases (the rollout: sampling, decoding and the device rewards, one program
per call; the advantages; the updates), images per second of the rollout, transitions per
second of the updates, each phase's MFU (model FLOPs over the chip's bf16 peak) and how much
of the epoch the phases leave idle.

Model FLOPs are counted from the models' jaxprs with plain attention (every matmul and
convolution of one sample's transformer call, VAE decode and reward), as `bench/_full_size.py`
counts them: the rollout's are its transformer calls (two a step with classifier-free
guidance), the decode and the reward; the update's are 3 x the policy's forward (the training
convention, whether LoRA or not) plus one forward of the reference for the KL, for every
trained transition.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import tempfile
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from flowgrpo_eqx.finetune import read_config, run_finetune
from flowgrpo_eqx.finetune._pipeline import PIPELINE_KINDS
from flowgrpo_eqx.finetune._rewards import _random_clip
from flowgrpo_eqx.models import PlainAttention
from flowgrpo_eqx.rewards import PickScore

from ._full_size import device_peak_tflops
from ._products import dot_flops, dot_generals


@dataclasses.dataclass(frozen=True)
class FinetuneRow:
    """One bench row: a published size, its image, LoRA, reward and batches."""

    name: str
    random_weights: str
    height: int
    width: int
    frames: int = 1
    rank: int = 32
    group_size: int = 9
    prompts_per_epoch: int = 2
    batch: int = 9
    train_batch: int = 9
    train_steps: int = 10
    text_length: int = 128
    remat: str = "dots"
    transition_chunk: int | None = 1

    def table(self, folder: pathlib.Path) -> dict[str, Any]:
        """The row's configuration as a TOML table."""
        prompts = folder / "prompts.txt"
        prompts.write_text("\n".join(f"prompt number {i}" for i in range(64)) + "\n")
        return {
            "seed": 0,
            "pipeline": {"random_weights": self.random_weights, "dtype": "bfloat16"},
            "prompts": {"train": str(prompts), "text_length": self.text_length},
            "reward": {"pickscore": {"kind": "pickscore", "model": "random"}},
            "algorithm": {
                "name": "flow_grpo",
                "flow_grpo": {"beta": 0.01, "transition_chunk": self.transition_chunk or "none"},
            },
            "lora": {"rank": self.rank, "alpha": 2.0 * max(self.rank, 1)},
            "sampling": {
                "height": self.height,
                "width": self.width,
                "frames": self.frames,
                "train_steps": self.train_steps,
                "group_size": self.group_size,
                "prompts_per_epoch": self.prompts_per_epoch,
                "batch": self.batch,
            },
            "training": {"batch": self.train_batch, "updates_per_epoch": 2, "epochs": 3},
            "precision": {"compute": "bfloat16", "remat": self.remat, "attention": "auto"},
            "checkpoint": {"every": 1000},
            "evaluation": {"before": False},
            "logging": {"writers": []},
        }


ROWS: dict[str, FinetuneRow] = {
    row.name: row
    for row in (
        # flow_grpo's per-device batch of its 4-GPU recipes (pickscore_sd3_4gpu: 8 images a
        # call), 512 x 512, LoRA r=32, PickScore; updates of 4 samples, one transition at a time.
        FinetuneRow("sd35m-512-lora32-pickscore", "sd3.5-medium", 512, 512, group_size=8,
                    batch=8, train_batch=4),
        FinetuneRow("sd35m-512-lora32-pickscore-nothing", "sd3.5-medium", 512, 512,
                    group_size=8, batch=8, train_batch=4, remat="nothing"),
        FinetuneRow("sd35m-512-lora32-pickscore-t2", "sd3.5-medium", 512, 512,
                    group_size=8, batch=8, train_batch=2),
        # Wan 2.1 1.3B at 480 x 832 (9 frames), LoRA r=32, PickScore on every frame.
        FinetuneRow("wan1.3b-480x832x9-lora32-pickscore", "wan2.1-t2v-1.3b", 480, 832, frames=9,
                    group_size=2, batch=2, train_batch=1, text_length=512),
        # The first row at 64 x 64 with 2 images: the whole path, small enough for a CPU.
        FinetuneRow("sd35m-64-lora32-pickscore-cpu", "sd3.5-medium", 64, 64, batch=2,
                    group_size=2, prompts_per_epoch=1, train_batch=1, train_steps=2),
    )
}  # fmt: skip


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _write(table: dict[str, Any], path: pathlib.Path) -> None:
    lines = [f"{k} = {_toml(v)}" for k, v in table.items() if not isinstance(v, dict)]

    def section(prefix: str, values: dict[str, Any]) -> None:
        lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in values.items() if not isinstance(v, dict))
        for key, value in values.items():
            if isinstance(value, dict):
                section(f"{prefix}.{key}", value)

    for name, values in table.items():
        if isinstance(values, dict):
            section(name, values)
    path.write_text("\n".join(lines) + "\n")


def _conv_flops(jaxpr: Any, times: int = 1) -> int:
    """2 x output elements x input channels per group x kernel size, for every convolution."""
    flops = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            lhs, rhs = (v.aval for v in eqn.invars)
            out = eqn.outvars[0].aval
            spec = eqn.params["dimension_numbers"]
            kernel = math.prod(rhs.shape[d] for d in spec.rhs_spec[2:])
            in_per_group = rhs.shape[spec.rhs_spec[1]]
            flops += 2 * times * math.prod(out.shape) * in_per_group * kernel
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    length = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
                    flops += _conv_flops(sub, times * length)
    return flops


def _flops(function: Any, *args: Any) -> float:
    jaxpr = jax.make_jaxpr(function)(*args).jaxpr
    return float(dot_flops(dot_generals(jaxpr)) + _conv_flops(jaxpr))


def _abstract(shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.ShapeDtypeStruct(shape, dtype)  # type: ignore[no-untyped-call]


def per_sample_flops(config: Any) -> dict[str, float]:
    """Model FLOPs of one sample's transformer call, VAE decode and PickScore, with plain
    attention, counted on abstract models (nothing is allocated)."""
    kind = PIPELINE_KINDS[config.kind]
    transformer = eqx.filter_eval_shape(lambda: kind.transformer(None, config))
    transformer = transformer.with_settings(attention=PlainAttention(), remat=None)
    vae = eqx.filter_eval_shape(lambda: kind.vae(None, config))
    clip = eqx.filter_eval_shape(lambda: _random_clip("pickscore", jnp.bfloat16))
    latent = kind.latent_shape(config)
    text_length = config.prompts.text_length
    if config.kind == "sd3":
        cond: Any = {
            "context": _abstract((77 + text_length, transformer.context_dim), jnp.bfloat16),
            "pooled": _abstract((transformer.pooled_dim,), jnp.bfloat16),
        }
    else:
        cond = _abstract((text_length, transformer.text_dim), jnp.bfloat16)
    x = _abstract(latent, jnp.bfloat16)
    t = _abstract((), jnp.float32)
    image = jax.eval_shape(lambda m, z: m.decode(z), vae, x)
    frame = _abstract(image.shape[-3:], jnp.float32)
    prompt = _abstract((1024,), jnp.float32)
    frames = image.shape[0] if len(image.shape) == 4 else 1
    return {
        "transformer": _flops(lambda m, a, b, c: m(a, b, c), transformer, x, t, cond),
        "decode": _flops(lambda m, z: m.decode(z), vae, x),
        "reward": frames * _flops(lambda s, i, p: PickScore(s)(i, p), clip, frame, prompt),
    }


def run(row: FinetuneRow, epochs: int, folder: pathlib.Path) -> dict[str, Any]:
    """Run the row's configuration for `epochs` epochs in `folder`; returns the report."""
    config_path = folder / "config.toml"
    table = row.table(folder)
    table["training"]["epochs"] = epochs
    _write(table, config_path)
    config = read_config(config_path).resolved()
    run_finetune(config, folder / "run", quiet=True, log=lambda m: print(m, file=sys.stderr))
    records = [
        json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    timed = [r for r in records if r.get("epoch", 0) >= 2]
    if not timed:
        raise ValueError("--epochs must be at least 2: the first epoch compiles.")
    seconds = {
        name: statistics.median(r[f"seconds_{name}"] for r in timed)
        for name in ("epoch", "sampling", "reward", "update")
    }
    flops = per_sample_flops(config)
    samples = config.sampling.prompts_per_epoch * config.sampling.group_size
    steps = config.sampling.train_steps or 1
    guided = 2 if config.sampling.guidance_scale and config.sampling.guidance_scale > 1 else 1
    trained = max(1, int(steps * config.algorithm_table.timestep_fraction))  # type: ignore[attr-defined]
    rollout_flops = samples * (
        steps * guided * flops["transformer"] + flops["decode"] + flops["reward"]
    )
    reference = 1 if config.algorithm_table.beta > 0 else 0  # type: ignore[attr-defined]
    update_flops = samples * trained * guided * (3 + reference) * flops["transformer"]
    peak = device_peak_tflops(jax.devices()[0]) * 1e12
    phases = seconds["sampling"] + seconds["reward"] + seconds["update"]
    return {
        "row": dataclasses.asdict(row),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "epochs_timed": len(timed),
        "seconds_per_epoch": round(seconds["epoch"], 3),
        "seconds_rollout": round(seconds["sampling"], 3),
        "seconds_advantages": round(seconds["reward"], 3),
        "seconds_update": round(seconds["update"], 3),
        "rollout_images_per_second": round(samples / seconds["sampling"], 3),
        "update_transitions_per_second": round(samples * trained / seconds["update"], 3),
        "rollout_mfu": round(rollout_flops / seconds["sampling"] / peak, 4),
        "update_mfu": round(update_flops / seconds["update"] / peak, 4),
        "epoch_over_phases": round(seconds["epoch"] / phases, 4),
        "model_tflop": {k: round(v / 1e12, 4) for k, v in flops.items()},
        "peak_tflops": peak / 1e12,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune", description=__doc__)
    parser.add_argument(
        "--row", choices=tuple(ROWS), action="append", help="a row (repeatable); default the first"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument(
        "--topology",
        choices=("v5e", "v5p"),
        default=None,
        help="compile the two programs for one chip of this TPU ahead of time and print their "
        "memory plans, instead of running (any host with libtpu)",
    )
    parser.add_argument(
        "--compilation-cache",
        default=None,
        help="JAX's persistent compilation cache in this folder, so that a later command on the "
        "same machine reuses the programs compiled",
    )
    arguments = parser.parse_args(argv)
    if arguments.compilation_cache is not None:
        jax.config.update("jax_compilation_cache_dir", arguments.compilation_cache)  # type: ignore[no-untyped-call]
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # type: ignore[no-untyped-call]
    folder = pathlib.Path(arguments.folder or tempfile.mkdtemp(prefix="bench-finetune-"))
    for name in arguments.row or [next(iter(ROWS))]:
        row_folder = folder / name
        row_folder.mkdir(parents=True, exist_ok=True)
        try:
            if arguments.topology is not None:
                from ._finetune_plan import plans

                _write(ROWS[name].table(row_folder), row_folder / "config.toml")
                config = read_config(row_folder / "config.toml").resolved()
                report = {"row": name, **plans(config, arguments.topology)}
            else:
                report = run(ROWS[name], arguments.epochs, row_folder)
        except Exception as error:  # noqa: BLE001 - a row that does not fit is a result
            report = {"row": name, "error": " ".join(str(error).split())[:600]}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
