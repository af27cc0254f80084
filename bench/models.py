"""`python -m bench.models`: the transformers' forward, training step and sampling, every layout
side by side.

```
python -m bench.models                      # MMDiT (every layout), DiT, FLUX, Wan (~25 min)
python -m bench.models --models mmdit       # one model
python -m bench.models --quick              # 3 rounds, stacked and unstacked only
python -m bench.models --all-layouts        # every layout of every model
python -m bench.models --rollout            # also the MMDiT rollout and its CFG batching
python -m bench.models --full-size          # SD3.5-M, FLUX.1-dev, Wan 2.1 at full size (TPU)
python -m bench.models --full-size --topology v5e   # the same compiled for a v5e, not run
```

`--full-size` (`bench/_full_size.py`) measures the published models at full size on one
accelerator: milliseconds, MFU and memory of the training step (docs/accelerators.md).

Per model and layout, three jit-compiled programs on one batch of random inputs: `forward`
(one velocity of every row, as a rollout step), `train` (value and gradient of a squared error
with respect to every float parameter: a training step without the optimizer) and `sample`
(10 Euler steps in one `lax.scan`). For each: the median milliseconds over interleaved rounds,
XLA's FLOPs (cost analysis), utilization against the machine's measured matmul peak (a
2048 x 2048 float32 matmul timed in the same rounds), and against the program's **shaped-matmul
ceiling**: every `dot_general` of the program's jaxpr (counted as often as it runs: scans
multiply), at its own shapes, dtypes and dimension numbers, run alone in one chain with nothing
else. `ceiling_utilization` = ceiling time / program time: 1.0 means the program spends all its
time in matmuls at the speed they have alone at those shapes.

Prints one JSON object on stdout (progress on stderr).
"""

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import ChunkedAttention, DiT, Flux, MMDiT, SaveDots, SaveNothing, Wan

from . import _baselines
from ._measure import temp_bytes, xla_flops
from ._op_sources import trace_events
from ._products import dot_flops, dot_generals
from ._setups import _perturb_zero_leaves
from ._timing import interleave, log, median, summary


BATCH = 4
SAMPLE_STEPS = 10


@dataclasses.dataclass
class Case:
    """One model at one size: how to build it in a layout, and one batch of inputs."""

    name: str
    description: str
    build: Callable[[dict[str, Any]], Any]
    layouts: dict[str, dict[str, Any]]
    inputs: Callable[[], tuple[jax.Array, jax.Array, Any]]


def _text(key: jax.Array, length: int, dim: int, pooled: int | None) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    cond = {"context": jax.random.normal(k1, (BATCH, length, dim), jnp.float32)}
    if pooled is not None:
        cond["pooled"] = jax.random.normal(k2, (BATCH, pooled), jnp.float32)
    return cond


def _latents(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(11), (BATCH, *shape), jnp.float32)
    t = jax.random.uniform(jax.random.key(12), (BATCH,), jnp.float32, 0.05, 0.95)
    return x, t


def _attention_layouts(quick: bool) -> dict[str, dict[str, Any]]:
    layouts: dict[str, dict[str, Any]] = {
        "stacked": {"stacked": True, "remat": None},
        "unstacked": {"stacked": False, "remat": None},
    }
    if not quick:
        layouts.update(
            {
                "stacked, remat dots": {"stacked": True, "remat": SaveDots()},
                "stacked, remat nothing": {"stacked": True, "remat": SaveNothing()},
                "stacked, chunked 128": {
                    "stacked": True,
                    "remat": None,
                    "attention": ChunkedAttention(128),
                },
                "unstacked, bfloat16": {"stacked": False, "remat": None, "dtype": "bfloat16"},
            }
        )
    return layouts


def _in_layout(model: Any, settings: dict[str, Any]) -> Any:
    settings = dict(settings)
    dtype = settings.pop("dtype", "float32")
    if isinstance(model, DiT):
        model = model.with_settings(stacked=settings["stacked"], remat=settings["remat"])
    else:
        model = model.with_settings(**settings)
    if dtype != "float32":
        model = jax.tree.map(
            lambda leaf: leaf.astype(dtype) if eqx.is_inexact_array(leaf) else leaf, model
        )
    return model


def mmdit_case(quick: bool) -> Case:
    base = _perturb_zero_leaves(
        MMDiT(
            image_size=32,
            channels=16,
            patch=2,
            depth=4,
            width=256,
            heads=4,
            context_length=64,
            context_dim=256,
            pooled_dim=256,
            qk_norm="rms_norm",
            dual_attention_layers=(0, 1),
            key=jax.random.key(0),
        ),
        0.02,
        0,
    )
    return Case(
        name="mmdit",
        description="SD3.5-style MMDiT: 4 blocks (dual attention in 0 and 1, RMS qk-norm), "
        "width 256, 4 heads, 32x32x16 latent (256 image tokens), 64 text tokens of width 256, "
        f"batch {BATCH}, float32",
        build=lambda settings: _in_layout(base, settings),
        layouts=_attention_layouts(quick),
        inputs=lambda: (*_latents((32, 32, 16)), _text(jax.random.key(13), 64, 256, 256)),
    )


def flux_case(quick: bool) -> Case:
    base = _perturb_zero_leaves(
        Flux(
            image_size=32,
            channels=16,
            double_depth=2,
            single_depth=4,
            width=256,
            heads=4,
            context_length=64,
            context_dim=256,
            pooled_dim=256,
            guidance_embeds=True,
            axes_dims=(16, 24, 24),
            key=jax.random.key(0),
        ),
        0.02,
        0,
    )

    def inputs() -> tuple[jax.Array, jax.Array, Any]:
        cond: dict[str, Any] = _text(jax.random.key(13), 64, 256, 256)
        cond["guidance"] = jnp.full((BATCH,), 3.5, jnp.float32)
        return (*_latents((32, 32, 16)), cond)

    return Case(
        name="flux",
        description="FLUX.1-dev-style: 2 double- and 4 single-stream blocks, width 256, 4 heads, "
        f"guidance embedding, 32x32x16 latent (256 tokens), 64 text tokens, batch {BATCH}, "
        "float32",
        build=lambda settings: _in_layout(base, settings),
        layouts=_attention_layouts(quick),
        inputs=inputs,
    )


def wan_case(quick: bool) -> Case:
    base = Wan(
        latent_size=(4, 16, 16),
        channels=16,
        depth=4,
        width=256,
        heads=4,
        ffn_dim=1024,
        context_length=64,
        text_dim=256,
        key=jax.random.key(0),
    )
    base = _perturb_zero_leaves(base, 0.02, 0)
    return Case(
        name="wan",
        description="Wan 2.1-style: 4 blocks, width 256, 4 heads, FFN 1024, 4x16x16x16 latent "
        f"(256 tokens), 64 text tokens of width 256, batch {BATCH}, float32",
        build=lambda settings: _in_layout(base, settings),
        layouts=_attention_layouts(quick),
        inputs=lambda: (
            *_latents((4, 16, 16, 16)),
            _text(jax.random.key(13), 64, 256, None)["context"],
        ),
    )


def dit_case(quick: bool) -> Case:
    from flowgrpo_eqx.shapes_demo import PROMPT_LENGTH, make_config

    settings = make_config().model
    base = _perturb_zero_leaves(
        DiT(
            image_size=16,
            channels=3,
            patch=settings.patch,
            width=settings.width,
            depth=settings.depth,
            heads=settings.heads,
            vocab_size=9,
            prompt_length=PROMPT_LENGTH,
            key=jax.random.key(0),
        ),
        0.02,
        0,
    )
    rows = 128

    def inputs() -> tuple[jax.Array, jax.Array, Any]:
        x = jax.random.normal(jax.random.key(11), (rows, 16, 16, 3), jnp.float32)
        t = jax.random.uniform(jax.random.key(12), (rows,), jnp.float32, 0.05, 0.95)
        tokens = jax.random.randint(jax.random.key(13), (rows, PROMPT_LENGTH), 0, 9)
        return x, t, tokens

    layouts: dict[str, dict[str, Any]] = {
        "unstacked": {"stacked": False, "remat": None},
        "stacked": {"stacked": True, "remat": None},
    }
    if not quick:
        layouts["unstacked, remat dots"] = {"stacked": False, "remat": SaveDots()}
    return Case(
        name="dit",
        description=f"the demo's DiT (width {settings.width}, depth {settings.depth}, heads "
        f"{settings.heads}, patch {settings.patch}) on 16x16x3 images, {rows} rows (the main "
        "job's minibatch of 64 rows through both CFG branches), float32",
        build=lambda s: _in_layout(base, s),
        layouts=layouts,
        inputs=inputs,
    )


CASES: dict[str, Callable[[bool], Case]] = {
    "mmdit": mmdit_case,
    "dit": dit_case,
    "flux": flux_case,
    "wan": wan_case,
}


# -- the three programs -------------------------------------------------------------------


def programs(model: Any, x: jax.Array, t: jax.Array, cond: Any) -> dict[str, tuple[Any, tuple]]:
    """`forward`, `train` and `sample` as `(jitted function, arguments)`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = x.astype(jax.tree.leaves(params)[0].dtype)
    target = jax.random.normal(jax.random.key(14), x.shape, x.dtype)
    grid = jnp.linspace(1.0, 0.0, SAMPLE_STEPS + 1, dtype=jnp.float32)

    def velocity(params: Any, x: jax.Array, t: jax.Array, cond: Any) -> jax.Array:
        out: jax.Array = jax.vmap(eqx.combine(params, static))(x, t, cond)
        return out

    def forward(params: Any, x: jax.Array, t: jax.Array, cond: Any) -> jax.Array:
        return velocity(params, x, t, cond)

    def train(params: Any, x: jax.Array, t: jax.Array, cond: Any, target: jax.Array) -> Any:
        def loss(params: Any) -> jax.Array:
            error = velocity(params, x, t, cond).astype(jnp.float32) - target
            return jnp.mean(jnp.square(error))

        return jax.value_and_grad(loss)(params)

    def sample(params: Any, x: jax.Array, cond: Any) -> jax.Array:
        def step(x: jax.Array, times: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            now, later = times
            v = velocity(params, x, jnp.full(x.shape[:1], now), cond)
            return x + (later - now).astype(x.dtype) * v, None

        final, _ = jax.lax.scan(step, x, (grid[:-1], grid[1:]))
        return final

    return {
        "forward": (forward, (params, x, t, cond)),
        "train": (train, (params, x, t, cond, target)),
        "sample": (sample, (params, x, cond)),
    }


# -- the shaped-matmul ceiling ------------------------------------------------------------


def matmul_ceiling(function: Callable[..., Any], args: tuple) -> tuple[Callable[[], Any], dict]:
    """The program's matmuls alone: each `dot_general` of its jaxpr, as often as it runs, in
    one dependent chain (a `fori_loop` per distinct matmul whose left operand is scaled by a
    carried scalar, so nothing is hoisted or merged; the scaling is `1/N` of a matmul's work).

    Returns the call and a description (distinct matmuls, instances, FLOPs).
    """
    dots = dot_generals(jax.make_jaxpr(function)(*args).jaxpr)
    operands = []
    for index, key in enumerate(dots):
        lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, _, _, _ = key
        k1, k2 = jax.random.split(jax.random.key(1000 + index))
        lhs = jax.random.normal(k1, lhs_shape, jnp.float32).astype(lhs_dtype)
        rhs = jax.random.normal(k2, rhs_shape, jnp.float32).astype(rhs_dtype)
        operands.append((lhs, rhs))
    flops = dot_flops(dots)
    keys = list(dots)

    def chain(operands: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
        carry = jnp.ones((), jnp.float32)
        for key, (lhs, rhs) in zip(keys, operands, strict=True):
            _, _, _, _, dims, precision, preferred = key

            def body(_: Any, carry: jax.Array, lhs=lhs, rhs=rhs, dims=dims, p=precision,
                     pref=preferred) -> jax.Array:  # fmt: skip
                out = jax.lax.dot_general(
                    lhs * carry.astype(lhs.dtype), rhs, dims, p, preferred_element_type=pref
                )
                return 1.0 + 1e-30 * out.reshape(-1)[0].astype(jnp.float32)

            carry = jax.lax.fori_loop(0, dots[key], body, carry)
        return carry

    compiled = jax.jit(chain).lower(operands).compile()
    info = {"distinct": len(dots), "instances": sum(dots.values()), "flops": flops}
    return (lambda: compiled(operands)), info


# -- measuring ----------------------------------------------------------------------------


def measure_case(case: Case, rounds: int) -> dict[str, Any]:
    """Every layout's three programs and their ceilings, timed in interleaved rounds."""
    x, t, cond = case.inputs()
    variants: dict[str, Callable[[], Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Any] = {}
    for layout, settings in case.layouts.items():
        model = case.build(settings)
        for program, (function, args) in programs(model, x, t, cond).items():
            name = f"{layout} | {program}"
            started = time.perf_counter()
            compiled = jax.jit(function).lower(*args).compile()
            seconds = time.perf_counter() - started
            ceiling, ceiling_info = matmul_ceiling(function, args)
            log(f"{case.name}: compiled {name} in {seconds:.1f}s")
            variants[name] = lambda compiled=compiled, args=args: compiled(*args)
            variants[f"{name} | ceiling"] = ceiling
            info[name] = {
                "xla_flops": xla_flops(compiled),
                "ceiling": ceiling_info,
                "temp_bytes": temp_bytes(compiled),
                "compile_seconds": round(seconds, 2),
            }
            if program == "forward":
                outputs[layout] = np.asarray(variants[name](), np.float64)
    matmul, matmul_flops = _baselines.matmul_baseline()
    variants["matmul"] = matmul
    log(f"{case.name}: timing {len(variants)} programs, {rounds} rounds")
    timings = interleave(variants, rounds)
    reference = next(iter(outputs.values()))
    results: dict[str, Any] = {}
    for name, details in info.items():
        layout, program = name.split(" | ")
        flops = details["ceiling"]["flops"]
        per_round_peak = (flops / matmul_flops) * timings.per_round("matmul", name)
        ceiling = timings.per_round(f"{name} | ceiling", name)
        entry = results.setdefault(layout, {})
        entry[program] = {
            "ms": round(1e3 * float(np.median(timings.wall[name])), 2),
            "peak_utilization": median(per_round_peak),
            "ceiling_utilization": median(ceiling),
            "ceiling_utilization_quartiles": summary(ceiling),
            **details,
        }
        if program == "forward":
            scale = float(np.max(np.abs(reference))) or 1.0
            entry["forward_max_difference_over_first_layout"] = float(
                np.max(np.abs(outputs[layout] - reference)) / scale
            )
    matmul_ms = 1e3 * float(np.median(timings.wall["matmul"]))
    return {
        "description": case.description,
        "matmul_peak_gflops": round(matmul_flops / matmul_ms / 1e6, 2),
        "layouts": results,
    }


# -- where the time goes --------------------------------------------------------------------


def _classify(text: str) -> dict[str, str]:
    """Each top-level HLO instruction's kind, from the optimised module's text."""
    kinds: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("%") or " = " not in line:
            continue
        name, rest = line[1:].split(" = ", 1)
        head = rest.split("(", 1)[0].split()
        if not head:
            continue
        op, shape = head[-1], " ".join(head[:-1]).split("{")[0]
        kind = op
        if op == "fusion":
            kind = "fusion"
            for part in rest.split(", "):
                if part.startswith("kind="):
                    kind = f"fusion {part[5:]}"
        kinds[name] = f"{kind} {shape}"
    return kinds


def _category(name: str, described: str) -> str:
    kind = described.split(" ")[0]
    if name.startswith("ynn_fusion") or kind in ("dot", "custom-call") or "dot" in name:
        return "matmul (YNNPACK fusions, with what XLA fused into them)"
    if "transpose" in name or kind in ("transpose", "copy") or name.startswith("copy"):
        return "transpose and copy"
    if kind in ("while", "conditional", "call") or name.startswith(("while", "call")):
        return "loop bodies (time inside counted by op)"
    if "reduce" in name or kind == "reduce":
        return "reductions (norms, softmax, sums)"
    if kind.startswith("fusion") or "fusion" in name:
        return "elementwise fusions (modulation, norms, activations)"
    return f"other ({kind or 'runtime'})"


def profile(case: Case, layout: str, program: str, calls: int, folder: str) -> dict[str, Any]:
    """Where one program's time goes: `jax.profiler`'s trace of `calls` runs, each XLA op's
    time summed and grouped by kind (matmuls, transposes and copies, elementwise fusions,
    reductions), with the largest ops named."""
    import collections

    x, t, cond = case.inputs()
    function, args = programs(case.build(case.layouts[layout]), x, t, cond)[program]
    compiled = jax.jit(function).lower(*args).compile()
    kinds = _classify(compiled.as_text())
    jax.block_until_ready(compiled(*args))  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))  # type: ignore[no-untyped-call]
    wall = (time.perf_counter() - started) / calls
    ops: collections.Counter[str] = collections.Counter()
    for event in trace_events(folder):
        name = str(event.get("name", ""))
        base = name.split(":")[0]
        if event.get("ph") == "X" and (base in kinds or name.startswith("ynn_fusion")):
            ops[name] += float(event.get("dur", 0.0)) / 1e3 / calls
    by_category: collections.Counter[str] = collections.Counter()
    for name, ms in ops.items():
        by_category[_category(name, kinds.get(name, ""))] += ms
    return {
        "program": f"{case.name} | {layout} | {program}",
        "wall_ms_per_call_while_tracing": round(1e3 * wall, 2),
        "ms_per_call_by_kind": {k: round(v, 2) for k, v in by_category.most_common()},
        "largest_ops_ms": {
            category: {
                f"{name} [{kinds.get(name, '')}]": round(ms, 2)
                for name, ms in ops.most_common()
                if _category(name, kinds.get(name, "")) == category
            }
            for category in list(by_category)[:3]
        },
        "note": "op times are summed over the threads that ran them, so they can exceed the "
        "wall time when XLA runs independent ops side by side",
    }


# -- the rollout and CFG batching ---------------------------------------------------------


def measure_rollout(rounds: int) -> dict[str, Any]:
    """The MMDiT rollout (`FlowRollout.generate`, SDE, CFG 4.5, 11 steps) against the bare
    guided forwards chained by Euler, and CFG's two branches in one call against two calls."""
    case = mmdit_case(quick=True)
    model = case.build(case.layouts["stacked"])
    _, _, cond = case.inputs()
    null = {"context": jnp.zeros((64, 256), jnp.float32), "pooled": jnp.zeros((256,))}
    inputs = fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=(32, 32, 16))
    objective = fg.FlowGRPOObjective(
        model, fg.RectifiedFlow(), inputs, guidance=fg.CFG(4.5), beta=0.04, clip_range=0.2
    )
    # `generate` samples the rows as given; `groups` (>= 2) only shapes `collect`.
    rollout = fg.FlowRollout(objective, reward=_NoReward(), groups=2, steps=11)
    rows = {key: np.asarray(value) for key, value in cond.items()}
    device_rows = jax.tree.map(jnp.asarray, rows)
    keys = iter(jax.random.split(jax.random.key(3), 10_000))
    bare = _baselines.model_rollout(rollout, model, device_rows)
    split = _baselines.model_rollout(rollout, model, device_rows, batched_guidance=False)
    variants = {
        "generate": lambda: rollout.generate(model, device_rows, next(keys)),
        "bare_euler_cfg_one_call": bare,
        "bare_euler_cfg_two_calls": split,
    }
    log(f"rollout: timing {' / '.join(variants)}, {rounds} rounds")
    timings = interleave(variants, rounds)
    return {
        "description": f"{case.description}; SDE rollout, 11 steps, CFG 4.5 ({2 * BATCH} model "
        "rows per step)",
        "generate_over_bare": summary(timings.per_round("generate", "bare_euler_cfg_one_call")),
        "two_calls_over_one_call": summary(
            timings.per_round("bare_euler_cfg_two_calls", "bare_euler_cfg_one_call")
        ),
        "ms": {name: round(1e3 * float(np.median(v)), 2) for name, v in timings.wall.items()},
    }


class _NoReward:
    name = "none"

    def __call__(self, samples: Any, rows: Any) -> Any:
        return np.zeros(samples.shape[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__)
    parser.add_argument(
        "--models", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES)
    )
    parser.add_argument("--quick", action="store_true", help="2 layouts per model, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7)")
    parser.add_argument("--rollout", action="store_true", help="also the MMDiT rollout")
    parser.add_argument(
        "--all-layouts",
        action="store_true",
        help="every layout for every model (default: every layout for the MMDiT, stacked and "
        "unstacked for the others)",
    )
    parser.add_argument(
        "--profile",
        metavar="MODEL:LAYOUT:PROGRAM",
        default=None,
        help="instead of timing, where one program's time goes (jax.profiler), e.g. "
        "'mmdit:stacked:train'",
    )
    parser.add_argument(
        "--full-size",
        nargs="?",
        const="all",
        default=None,
        metavar="ROWS",
        help="instead: the published models at full size on this accelerator (all rows, or "
        "comma-separated row names of bench/_full_size.py)",
    )
    parser.add_argument(
        "--topology",
        choices=("v5e", "v5p"),
        default=None,
        help="with --full-size: compile for one chip of this TPU ahead of time (libtpu), "
        "run nothing",
    )
    parser.add_argument("--calls", type=int, default=5, help="with --full-size: timed calls")
    parser.add_argument(
        "--profile-row",
        default=None,
        help="with --full-size: also profile this row on the device (jax.profiler)",
    )
    args = parser.parse_args(argv)
    if args.full_size is not None:
        from . import _full_size

        report = _full_size.run(args.full_size, args.calls, args.topology, args.profile_row)
        print(json.dumps(report, indent=1))
        return
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(CASES)}")
    if args.profile is not None:
        parts = args.profile.split(":")
        if len(parts) != 3 or parts[0] not in CASES:
            parser.error(f"--profile: want MODEL:LAYOUT:PROGRAM, got {args.profile!r}")
        case = CASES[parts[0]](False)
        if parts[1] not in case.layouts or parts[2] not in ("forward", "train", "sample"):
            parser.error(f"--profile: layouts {list(case.layouts)}; forward, train or sample")
        folder = tempfile.mkdtemp(prefix="flowgrpo-profile-")
        print(json.dumps(profile(case, parts[1], parts[2], 5, folder), indent=1))
        return
    rounds = args.rounds if args.rounds is not None else 3 if args.quick else 7
    started = time.perf_counter()
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
        },
        "rounds": rounds,
    }
    for name in names:
        every = (name == "mmdit" or args.all_layouts) and not args.quick
        report[name] = measure_case(CASES[name](not every), rounds)
        log(f"{name}: {json.dumps(report[name])}")
    if args.rollout:
        report["rollout"] = measure_rollout(rounds)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
