"""`python -m bench.scale [--size sd35_medium|sd3_medium|flux_dev|wan_1_3b|wan_14b|small]
[--resolution 512|1024|2048 | --height H --width W --frames F] [--rows-per-device R]
[--devices 8] [--sequence-parallel N [--sequence-strategy ulysses|ring]] [--modes a,b]`: the
memory and compile plan of a step.

Builds the Flow-GRPO training step (`FlowGRPOObjective` with a KL reference, `beta = 0.04`,
AdamW) of the model for `--devices` simulated CPU devices, with each release's guidance:
classifier-free 4.5 for SD3 (the Flow-GRPO release), the embedded guidance 3.5 of FLUX.1-dev
(flow_grpo's FLUX recipes; its grid `RectifiedFlow(shift=flux_shift(tokens), grid=fg.FluxGrid())`),
none for Wan 2.1 (DanceGRPO's Wan trainer runs with `--cfg 0`). Sizes: SD3.5-Medium and
SD3-Medium (`MMDiT`) at `--resolution`, FLUX.1-dev (`Flux`) at `--resolution`, Wan 2.1-T2V-1.3B
and 14B (`Wan`) at `--height` x `--width` (default 480 x 832) and `--frames` (default 81; the
VAE keeps `1 + (frames - 1) / 4` latent frames). The step is built on simulated devices
(`--xla_force_host_platform_device_count`), abstractly: the model and the training state are
`eqx.filter_eval_shape`d, the step is lowered and compiled for the mesh (under the mesh, as
`Trainer.update` runs it), nothing is executed and no parameter is materialised. `R` rows per
device, one recorded transition per row. `--sequence-parallel N` makes the mesh `("data",
"sequence")` of `devices / N` x `N` (`data_mesh(sequence=N)`): each row's image or video tokens
are split over the N devices of its data slot (`--sequence-strategy`, default `ulysses`), `R`
is then the rows per data slot, and FSDP splits over all the devices. The model is stacked (a
scan over each group of blocks), rematerialised per block (`--remat`, default `nothing`) with
chunked attention (`--attention`, default `chunked`: CPU has no cuDNN, and the splash kernel
runs on one device only); `--microbatches M`
accumulates over M.

`--topology v5e-8|v5p-8` compiles for the chips of a TPU slice ahead of time instead
(`jax.experimental.topologies`, with `libtpu` installed; no TPU needed): the TPU compiler's
plan; a mode the compiler refuses to fit is reported as `does_not_fit`.

Modes (`--modes`, all by default):

- `lora_bfloat16`: rank-32 LoRA adapters (alpha 64, float32) on every attention projection,
  as the Flow-GRPO release; the reference is the policy with its adapters off; the base
  replicated and held in bfloat16, as the releases hold their frozen base;
- `fsdp_bfloat16`: full fine-tuning, the policy, its reference and AdamW's moments split with
  `shard_parameters`'s FSDP layout, the model computing in bfloat16 (float32 master weights);
- `fsdp_float32`: the same in float32;
- `replicated_float32`: every device holds the policy, the reference and AdamW's moments.

Per mode and per device: the bytes of the variables and of the optimizer state (exact, from
the arrays' shapes and shardings), XLA's temporaries of the compiled step
(`memory_analysis().temp_size_in_bytes`), the compile time, the all-gathers of the compiled
program split into weights (a parameter's shape, whole or one layer of a stack) and
activations (anything else), and every collective of the program by kind (all-gather,
all-reduce, reduce-scatter, all-to-all, collective-permute: each op once, a loop body's
once). Prints one JSON object.
"""

import argparse
import json
import os
import re
import sys
import time
from typing import Any


MODES = ("lora_bfloat16", "fsdp_bfloat16", "fsdp_float32", "replicated_float32")
LORA_RANK = 32
LORA_ALPHA = 64
BETA = 0.04
MIN_ELEMENTS = 4096


def _force_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    if "jax" in sys.modules:
        raise RuntimeError("bench.scale must set the device count before JAX is imported.")


TOPOLOGIES = {"v5e-8": ("v5e:2x4", 8), "v5p-8": ("v5p:2x2x1", 4)}
"""`--topology`: the TPU slices the plan can be compiled for, as `jax.experimental.topologies`
names them, and their chips (a v5p-8 is 4 chips of two TensorCores each)."""


def topology_mesh(name: str, sequence: int) -> Any:
    """The mesh `data_mesh` would make, over the chips of the TPU slice `name` (abstract
    devices: programs compile for it ahead of time, nothing can run)."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from flowgrpo_eqx._distributed import DATA_AXIS, SEQUENCE_AXIS

    layout, chips = TOPOLOGIES[name]
    devices = np.asarray(topologies.get_topology_desc(platform="tpu", topology_name=layout).devices)
    if sequence == 1:
        return Mesh(devices, (DATA_AXIS,))
    return Mesh(devices.reshape(chips // sequence, sequence), (DATA_AXIS, SEQUENCE_AXIS))


def attention_layers(model: Any) -> list[Any]:
    """Every attention projection (queries, keys, values, output) of an `MMDiT`, a `Flux` or a
    `Wan`: the layers the Flow-GRPO release adapts (`to_q`, `to_k`, `to_v`, `to_out.0` and the
    text stream's)."""
    layers = []
    for block in model.blocks:
        attentions = [
            getattr(block, name, None) for name in ("attn", "attn2", "self_attn", "cross_attn")
        ] + [getattr(getattr(block, stream, None), "attn", None) for stream in ("image", "context")]
        for attn in attentions:
            if attn is not None:
                layers += [attn.q, attn.k, attn.v] + ([] if attn.out is None else [attn.out])
    return layers


def weight_shapes(tree: Any) -> set[tuple[int, ...]]:
    """Every shape a gathered weight can take: whole, one layer of a stack, transposed."""
    import jax

    shapes: set[tuple[int, ...]] = set()
    for leaf in jax.tree.leaves(tree):
        shape = tuple(getattr(leaf, "shape", ()))
        for form in (shape, shape[1:], (1, *shape[1:])):
            shapes.update({form, tuple(reversed(form))})
            if len(form) == 3:
                shapes.add((form[0], form[2], form[1]))
    return shapes


def all_gathers(hlo_text: str, shapes: set[tuple[int, ...]]) -> tuple[int, list[Any]]:
    """`(weight gathers, activation gathers' shapes)` of a compiled HLO text."""
    found = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo_text)
    results = [tuple(int(size) for size in dims.split(",") if size) for dims in found]
    activations = [shape for shape in results if shape not in shapes]
    return len(results) - len(activations), activations


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo_text: str) -> dict[str, int]:
    """How many ops of each collective kind a compiled HLO text holds (asynchronous pairs
    counted once, by their start)."""
    return {kind: len(re.findall(rf"\s{kind}(?:-start)?\(", hlo_text)) for kind in COLLECTIVES}


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8}


def largest_reductions(hlo_text: str, count: int = 3) -> list[str]:
    """The largest results of the compiled program's all-reduces (`dtype[shape] = bytes`),
    largest first: a whole gradient reduced on every device shows as one of a parameter's
    full size. (Tuple-shaped all-reduces are not counted.)"""
    found = re.findall(r"= \(?(\w+)\[([\d,]*)\][^ ]* all-reduce(?:-start)?\(", hlo_text)
    sized = []
    for dtype, dims in found:
        shape = [int(size) for size in dims.split(",") if size]
        elements = 1
        for size in shape:
            elements *= size
        sized.append((elements * _BYTES.get(dtype, 4), f"{dtype}{shape}"))
    sized.sort(reverse=True)
    return [f"{name} = {size / 1e9:.3f} GB" for size, name in sized[:count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument(
        "--size",
        choices=("sd35_medium", "sd3_medium", "flux_dev", "wan_1_3b", "wan_14b", "small"),
        default="sd35_medium",
    )
    parser.add_argument("--resolution", type=int, choices=(512, 1024, 2048), default=512)
    parser.add_argument("--height", type=int, default=480, help="Wan: the video's height")
    parser.add_argument("--width", type=int, default=832, help="Wan: the video's width")
    parser.add_argument("--frames", type=int, default=81, help="Wan: the video's frames")
    parser.add_argument("--rows-per-device", type=int, default=9)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument(
        "--sequence-parallel", type=int, default=1, help="the size of the mesh's sequence axis"
    )
    parser.add_argument("--sequence-strategy", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--remat", choices=("nothing", "dots", "none"), default="nothing")
    parser.add_argument("--attention", choices=("chunked", "xla", "splash"), default="chunked")
    parser.add_argument(
        "--topology",
        choices=tuple(TOPOLOGIES),
        default=None,
        help="compile for this TPU slice ahead of time (needs libtpu; nothing runs) instead of "
        "simulated CPU devices; --devices is then the slice's chip count",
    )
    parser.add_argument("--attention-chunk", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    arguments = parser.parse_args(argv)
    modes = arguments.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes names unknown modes {unknown}; known: {list(MODES)}")
    if arguments.sequence_parallel < 1 or arguments.devices % arguments.sequence_parallel:
        parser.error(
            f"--sequence-parallel ({arguments.sequence_parallel}) must be a positive divisor "
            f"of --devices ({arguments.devices})"
        )
    if arguments.topology is None:
        _force_devices(arguments.devices)
    else:
        arguments.devices = TOPOLOGIES[arguments.topology][1]
        if arguments.devices % arguments.sequence_parallel:
            parser.error(f"--sequence-parallel must divide {arguments.topology}'s chips")

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import flowgrpo_eqx as fg
    from flowgrpo_eqx import lora
    from flowgrpo_eqx._distributed import DATA_AXIS, fsdp_spec
    from flowgrpo_eqx.models import (
        Flux,
        MMDiT,
        Wan,
        attention_from_name,
        remat_from_name,
        sequence_strategy_from_name,
    )
    from flowgrpo_eqx.train import Trainer

    layout = dict(
        stacked=True,
        remat=remat_from_name(arguments.remat),
        attention=attention_from_name(arguments.attention, arguments.attention_chunk),
        sequence_strategy=sequence_strategy_from_name(arguments.sequence_strategy),
    )
    settings: dict[str, Any]
    model_class: Any = MMDiT
    if arguments.size == "sd35_medium":
        settings = MMDiT.sd35_medium_config()
    elif arguments.size == "sd3_medium":
        settings = MMDiT.sd3_medium_config()
    elif arguments.size == "flux_dev":
        model_class = Flux
        side = arguments.resolution // 8  # the VAE's 8x downsampling
        settings = {**Flux.dev_config(), "image_size": (side, side)}
    elif arguments.size in ("wan_1_3b", "wan_14b"):
        model_class = Wan
        frames = 1 + (arguments.frames - 1) // 4  # the VAE's 4x in time, the first frame kept
        latent = (frames, arguments.height // 8, arguments.width // 8)
        config = Wan.t2v_1_3b_config() if arguments.size == "wan_1_3b" else Wan.t2v_14b_config()
        settings = {**config, "latent_size": latent}
    else:
        settings = dict(
            image_size=16, channels=4, patch=2, depth=3, context_length=8, context_dim=32,
            pooled_dim=32, qk_norm="rms_norm", dual_attention_layers=(0,),
        )  # fmt: skip
    if arguments.size in ("sd35_medium", "sd3_medium"):
        settings["image_size"] = arguments.resolution // 8
    settings.update(layout)
    devices, sequence = arguments.devices, arguments.sequence_parallel
    if arguments.topology is None:
        mesh = fg.data_mesh(devices, sequence=sequence)
    else:
        mesh = topology_mesh(arguments.topology, sequence)
    fsdp_axes = tuple(mesh.axis_names) if sequence > 1 else DATA_AXIS
    rows = devices // sequence * arguments.rows_per_device

    def array_bytes(leaf: Any, spec: PartitionSpec) -> int:
        """Bytes of `leaf` on one device under `spec` (split over every device, or whole)."""
        size: int = leaf.size * jnp.dtype(leaf.dtype).itemsize
        split = any(axis is not None for axis in spec)
        return size // devices if split else size

    def place(tree: Any, fsdp: bool) -> tuple[Any, int]:
        """Abstract arrays with their shardings, and the bytes one device holds."""
        held = 0

        def one(leaf: Any) -> Any:
            nonlocal held
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                return leaf
            spec = (
                fsdp_spec(leaf.shape, devices, MIN_ELEMENTS, fsdp_axes)
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

    model = eqx.filter_eval_shape(lambda key: model_class(**settings, key=key), jax.random.key(0))
    parameters = sum(
        leaf.size for leaf in jax.tree.leaves(model) if isinstance(leaf, jax.ShapeDtypeStruct)
    )
    guidance: Any
    if isinstance(model, Wan):
        latent = (*model.latent_size, model.channels)
        input_spec = fg.InputSpec(latent_shape=latent)
        cond: Any = jax.ShapeDtypeStruct((rows, model.context_length, model.text_dim), jnp.float32)
        flow = fg.RectifiedFlow(shift=3.0)
        guidance = None
    else:
        latent = (
            (*model.image_size, model.channels)
            if isinstance(model, Flux)
            else (model.image_size, model.image_size, model.channels)
        )
        text = {"context": (model.context_length, model.context_dim), "pooled": (model.pooled_dim,)}
        cond = {k: jax.ShapeDtypeStruct((rows, *shape), jnp.float32) for k, shape in text.items()}
        if isinstance(model, Flux):
            input_spec = fg.InputSpec(select=("context", "pooled"), latent_shape=latent)
            tokens = (latent[0] // 2) * (latent[1] // 2)
            flow = fg.RectifiedFlow(shift=fg.flux_shift(tokens), grid=fg.FluxGrid())
            guidance = fg.EmbeddedGuidance(3.5)
        else:
            null = {k: jnp.zeros(shape, jnp.float32) for k, shape in text.items()}
            input_spec = fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=latent)
            flow = fg.RectifiedFlow(shift=3.0)
            guidance = fg.CFG(4.5)
    batch = fg.Transitions(
        latents=jax.ShapeDtypeStruct((rows, 1, *latent), jnp.float32),
        next_latents=jax.ShapeDtypeStruct((rows, 1, *latent), jnp.float32),
        timesteps=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        next_timesteps=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        old_log_probs=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        transition_mask=jax.ShapeDtypeStruct((rows, 1), jnp.bool_),
        advantages=jax.ShapeDtypeStruct((rows,), jnp.float32),
        cond=cond,
    )
    results: dict[str, Any] = {}
    for mode in modes:
        started = time.perf_counter()
        policy = model
        if mode.startswith("lora"):
            policy = eqx.filter_eval_shape(
                lambda m, key: lora.add(
                    m, LORA_RANK, key=key, alpha=LORA_ALPHA, where=attention_layers
                ),
                model,
                jax.random.key(1),
            )
            # The frozen base as the releases hold it (diffusers' `transformer.to(bfloat16)`,
            # the adapters cast back to float32 for training): adapted layers then merge into
            # bfloat16 weights, and no float32 copy of the base exists.
            base = jax.tree.map(
                lambda leaf: (
                    jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16)
                    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.dtype == jnp.float32
                    else leaf
                ),
                policy.base,
            )
            policy = eqx.tree_at(lambda p: p.base, policy, base)
        objective = fg.FlowGRPOObjective(
            policy,
            flow,
            input_spec,
            guidance=guidance,
            beta=BETA,
            clip_range=1e-4,
            precision="bfloat16" if mode.endswith("bfloat16") else "float32",
        )
        trainer = Trainer(objective, microbatches=arguments.microbatches)
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

        with jax.set_mesh(mesh):  # as `Trainer.update` runs it
            lowered = jax.jit(step, donate_argnums=2).lower(*dynamic)
            try:
                compiled = lowered.compile()
            except Exception as error:  # noqa: BLE001 - a TPU compiler refusing to fit is a result
                if arguments.topology is None:
                    raise
                results[mode] = {
                    "variables_bytes_per_device": variable_bytes,
                    "optimizer_bytes_per_device": optimizer_bytes,
                    "does_not_fit": " ".join(str(error).split())[:300],
                }
                print(f"[scale] {mode}: {results[mode]}", file=sys.stderr, flush=True)
                continue
        seconds = time.perf_counter() - started
        analysis = compiled.memory_analysis()
        weights, activations = all_gathers(compiled.as_text(), weight_shapes(state))
        temporaries = int(analysis.temp_size_in_bytes)
        results[mode] = {
            "variables_bytes_per_device": variable_bytes,
            "optimizer_bytes_per_device": optimizer_bytes,
            "state_bytes_per_device": variable_bytes + optimizer_bytes,
            "xla_temp_bytes_per_device": temporaries,
            "state_plus_temp_gb_per_device": round(
                (variable_bytes + optimizer_bytes + temporaries) / 1e9, 2
            ),
            "compile_seconds": round(seconds, 1),
            "weight_all_gathers": weights,
            "activation_all_gathers": len(activations),
            "collectives": collectives(compiled.as_text()),
            "largest_all_reduces": largest_reductions(compiled.as_text()),
        }
        print(f"[scale] {mode}: {results[mode]}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {
        "size": arguments.size,
        "settings": {k: v for k, v in settings.items() if not callable(v)},
        "parameters": int(parameters),
        "latent": list(latent),
        "devices": devices,
        "compiled_for": arguments.topology or "cpu (simulated devices)",
        "sequence_parallel": sequence,
        "sequence_strategy": arguments.sequence_strategy if sequence > 1 else None,
        "rows_per_data_slot": rows // (devices // sequence),
        "microbatches": arguments.microbatches,
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
