"""`python -m bench.scale [--size sd3_medium|small] [--devices 8] [--modes a,b]`: the scale plan.

Builds the Flow-GRPO training step (`FlowGRPOObjective` with a KL reference, `beta = 0.04`,
classifier-free guidance, AdamW) of the `MMDiT` for `--devices` simulated CPU devices
(`--xla_force_host_platform_device_count`), abstractly: the model and the training state are
`eqx.filter_eval_shape`d, the step is lowered and compiled for the mesh, nothing is executed
and no parameter is materialised. One row per device, one recorded transition per row.

Modes (`--modes`, all by default):

- `replicated_float32`: every device holds the policy, the reference and AdamW's moments;
- `fsdp_float32`: the same state split with `shard_parameters`'s FSDP layout;
- `fsdp_bfloat16`: as `fsdp_float32`, the model computing in bfloat16 (float32 master weights);
- `lora_fsdp_bfloat16`: rank-64 LoRA adapters on every linear layer, FSDP, bfloat16; the
  reference is the policy with its adapters off, so no copy is kept.

Per mode and per device: the bytes of the variables and of the optimizer state (exact, from
the arrays' shapes and shardings) and XLA's temporaries of the compiled step
(`memory_analysis().temp_size_in_bytes`). Prints one JSON object.
"""

import argparse
import json
import os
import sys
import time
from typing import Any


MODES = ("replicated_float32", "fsdp_float32", "fsdp_bfloat16", "lora_fsdp_bfloat16")
LORA_RANK = 64
BETA = 0.04
MIN_ELEMENTS = 4096


def _force_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    if "jax" in sys.modules:
        raise RuntimeError("bench.scale must set the device count before JAX is imported.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--size", choices=("sd3_medium", "small"), default="sd3_medium")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    arguments = parser.parse_args(argv)
    modes = arguments.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes names unknown modes {unknown}; known: {list(MODES)}")
    _force_devices(arguments.devices)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import flowgrpo_eqx as fg
    from flowgrpo_eqx import lora
    from flowgrpo_eqx._distributed import DATA_AXIS, fsdp_spec
    from flowgrpo_eqx.models import MMDiT
    from flowgrpo_eqx.train import Trainer

    settings: dict[str, Any] = (
        MMDiT.sd3_medium_config()
        if arguments.size == "sd3_medium"
        else dict(
            image_size=16,
            channels=4,
            patch=2,
            depth=2,
            context_length=8,
            context_dim=32,
            pooled_dim=32,
        )  # fmt: skip
    )
    devices = arguments.devices
    mesh = fg.data_mesh(devices)
    rows = devices

    def array_bytes(leaf: Any, spec: PartitionSpec) -> int:
        """Bytes of `leaf` on one device under `spec`."""
        size: int = leaf.size * jnp.dtype(leaf.dtype).itemsize
        split = any(axis == DATA_AXIS for axis in spec)
        return size // devices if split else size

    def place(tree: Any, fsdp: bool) -> tuple[Any, int]:
        """Abstract arrays with their shardings, and the bytes one device holds."""
        held = 0

        def one(leaf: Any) -> Any:
            nonlocal held
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                return leaf
            spec = (
                fsdp_spec(leaf.shape, devices, MIN_ELEMENTS)
                if fsdp and leaf.ndim > 0
                else PartitionSpec()  # type: ignore[no-untyped-call]
            )
            held += array_bytes(leaf, spec)
            sharding = NamedSharding(mesh, spec)  # type: ignore[no-untyped-call]
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

        return jax.tree.map(one, tree), held

    def by_rows(tree: Any) -> Any:
        sharding = NamedSharding(mesh, PartitionSpec(DATA_AXIS))  # type: ignore[no-untyped-call]
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), tree
        )

    model = eqx.filter_eval_shape(lambda key: MMDiT(**settings, key=key), jax.random.key(0))
    latent = (model.image_size, model.image_size, model.channels)
    null = {
        "context": jnp.zeros((model.context_length, model.context_dim), jnp.float32),
        "pooled": jnp.zeros((model.pooled_dim,), jnp.float32),
    }
    parameters = sum(
        leaf.size for leaf in jax.tree.leaves(model) if isinstance(leaf, jax.ShapeDtypeStruct)
    )
    batch = fg.Transitions(
        latents=jax.ShapeDtypeStruct((rows, 1, *latent), jnp.float32),
        next_latents=jax.ShapeDtypeStruct((rows, 1, *latent), jnp.float32),
        timesteps=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        next_timesteps=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        old_log_probs=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        transition_mask=jax.ShapeDtypeStruct((rows, 1), jnp.bool_),
        advantages=jax.ShapeDtypeStruct((rows,), jnp.float32),
        cond={
            "context": jax.ShapeDtypeStruct(
                (rows, model.context_length, model.context_dim), jnp.float32
            ),
            "pooled": jax.ShapeDtypeStruct((rows, model.pooled_dim), jnp.float32),
        },
    )
    results: dict[str, Any] = {}
    for mode in modes:
        started = time.perf_counter()
        policy = model
        if mode.startswith("lora"):
            policy = eqx.filter_eval_shape(
                lambda m, key: lora.add(m, LORA_RANK, key=key), model, jax.random.key(1)
            )
        objective = fg.FlowGRPOObjective(
            policy,
            fg.RectifiedFlow(shift=3.0),
            fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=latent),
            guidance=fg.CFG(4.5),
            beta=BETA,
            clip_range=1e-4,
            precision="bfloat16" if mode.endswith("bfloat16") else "float32",
        )
        trainer = Trainer(objective)
        state = eqx.filter_eval_shape(trainer.init, jax.random.key(2))
        fsdp = "fsdp" in mode
        variables, variable_bytes = place(state.variables, fsdp)
        opt_state, optimizer_bytes = place(state.opt_state, fsdp)
        placed_state = eqx.tree_at(
            lambda s: (s.variables, s.opt_state), state, (variables, opt_state)
        )
        # The objective's own copy of the initial model is never read by the step; it is
        # passed sharded like the policy so that it does not distort the compiled program.
        placed_trainer, _ = place(trainer, fsdp)
        is_abstract = lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct)  # noqa: E731
        inputs = (placed_trainer, by_rows(batch), placed_state)
        dynamic, static = eqx.partition(inputs, is_abstract)

        def step(trainer_part: Any, batch_part: Any, state_part: Any, static: Any = static) -> Any:
            parts = (trainer_part, batch_part, state_part)
            trainer_, batch_, state_ = eqx.combine(parts, static)
            return trainer_._update(state_, batch_)

        compiled = jax.jit(step, donate_argnums=2).lower(*dynamic).compile()
        analysis = compiled.memory_analysis()
        results[mode] = {
            "variables_bytes_per_device": variable_bytes,
            "optimizer_bytes_per_device": optimizer_bytes,
            "state_bytes_per_device": variable_bytes + optimizer_bytes,
            "xla_temp_bytes_per_device": int(analysis.temp_size_in_bytes),
            "compile_seconds": round(time.perf_counter() - started, 1),
        }
        print(f"[scale] {mode}: {results[mode]}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "size": arguments.size,
        "settings": {k: v for k, v in settings.items() if not callable(v)},
        "parameters": int(parameters),
        "devices": devices,
        "rows_per_device": rows // devices,
        "lora_rank": LORA_RANK,
        "fsdp_min_elements": MIN_ELEMENTS,
        "modes": results,
    }
    if "replicated_float32" in results and "fsdp_float32" in results:
        replicated = results["replicated_float32"]["state_bytes_per_device"]
        report["fsdp_state_over_replicated_per_device_share"] = results["fsdp_float32"][
            "state_bytes_per_device"
        ] / (replicated / devices)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
