"""The published models at full size on one accelerator: `python -m bench.models --full-size`.

Each row is one jit-compiled program on random bfloat16 weights (timing does not depend on
the values): the **training step without the optimizer** (`train`: value and gradient of a
squared error on the velocity with respect to every weight) or the **whole step with AdamW**
(`adamw`: the same gradient, the optimizer's update and the new weights; LoRA adapters of rank
32 on every attention projection, or every weight). Reported per row: milliseconds (median of
`--calls` calls after one warm-up), **MFU** (model FLOPs per second over the chip's peak), the
compiled plan's memory with the compiler's own peak (`plan_gib`), and the device allocator's
high-water mark in the process so far. (XLA's own cost analysis counts a loop body once, so it
says nothing of a scanned model's FLOPs.)

Model FLOPs are `3 x` the forward's matmul FLOPs, counted from the forward's jaxpr with plain
attention (every `dot_general` at its shapes, as often as it runs: the model's function, the
same whatever implementation of attention or remat computes it, but the products of a
function named in `NOT_MODEL_PRODUCTS`, which are not the architecture's): the forward once,
the backward twice. The peak is the device kind's published bf16 figure (`PEAK_TFLOPS`); a large
bf16 matmul is timed beside it (`matmul_tflops`) to show what the chip reaches in practice.

`--topology v5e` compiles every row ahead of time for one TPU v5e chip instead (on any host
with `libtpu` installed; nothing runs): the memory each program needs and whether it fits,
to choose the rows before spending time on the chip.
"""

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flowgrpo_eqx import lora
from flowgrpo_eqx.models import BlockRemat, Flux, MMDiT, Wan, attention_from_name, remat_from_name

from ._op_sources import LOOPS, by_function, instruction_metadata, summarise, trace_events
from ._products import dot_flops, dot_generals
from ._timing import log


PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5": 459.0, "TPU v4": 275.0, "TPU v6 lite": 918.0}
"""Published dense bf16 peaks per chip, by `jax.Device.device_kind`."""

LORA_RANK = 32
LORA_ALPHA = 64


RematNames: TypeAlias = str | tuple[str, ...] | None
"""A row's remat by the policies' names (`remat_from_name`): one for every block, one per
block, or `None` for none."""


def block_remat(names: RematNames) -> BlockRemat:
    """The models' `remat` a row names: `remat_from_name` of each name; `None` for none."""
    if names is None:
        return None
    if isinstance(names, tuple):
        return tuple(remat_from_name(name) for name in names)
    return remat_from_name(names)


@dataclasses.dataclass(frozen=True)
class Row:
    """One program to measure: a model at one size, layout and batch."""

    name: str
    model: str
    batch: int
    remat: RematNames
    attention: str
    attention_chunk: int = 512
    program: str = "train"  # "train", "adamw_lora", "adamw_full"
    flux_blocks: tuple[int, int] = (19, 38)
    resolution: int = 512
    frames: int = 33
    matmul_precision: str | None = None
    stacked: bool = True


def _build(row: Row, mmdit_config: dict[str, Any] | None = None) -> tuple[Any, tuple[Any, ...]]:
    """The model (abstract) and its abstract per-batch inputs; `mmdit_config` replaces the
    published SD3.5-Medium configuration (`bench.precision_programs`: fewer blocks)."""
    layout = dict(
        stacked=row.stacked,
        remat=block_remat(row.remat),
        attention=attention_from_name(row.attention, row.attention_chunk),
    )
    key = jax.random.key(0)
    b = row.batch
    f32 = jnp.float32
    if row.model == "sd35_medium":
        published = MMDiT.sd35_medium_config() if mmdit_config is None else mmdit_config
        config = {**published, "image_size": row.resolution // 8}
        model = eqx.filter_eval_shape(MMDiT, **{**config, **layout}, key=key)
        side = row.resolution // 8
        x = jax.ShapeDtypeStruct((b, side, side, 16), f32)
        cond = {
            "context": jax.ShapeDtypeStruct((b, 333, 4096), f32),
            "pooled": jax.ShapeDtypeStruct((b, 2048), f32),
        }
    elif row.model == "flux_dev":
        double, single = row.flux_blocks
        side = row.resolution // 8
        config = {
            **Flux.dev_config(),
            "image_size": (side, side),
            "double_depth": double,
            "single_depth": single,
        }
        model = eqx.filter_eval_shape(Flux, **{**config, **layout}, key=key)
        x = jax.ShapeDtypeStruct((b, side, side, 16), f32)
        cond = {
            "context": jax.ShapeDtypeStruct((b, 512, 4096), f32),
            "pooled": jax.ShapeDtypeStruct((b, 768), f32),
            "guidance": jax.ShapeDtypeStruct((b,), f32),
        }
    elif row.model == "wan_1_3b":
        latent = (1 + (row.frames - 1) // 4, 480 // 8, 832 // 8)
        config = {**Wan.t2v_1_3b_config(), "latent_size": latent}
        model = eqx.filter_eval_shape(Wan, **{**config, **layout}, key=key)
        x = jax.ShapeDtypeStruct((b, *latent, 16), f32)
        cond = jax.ShapeDtypeStruct((b, 512, 4096), f32)
    else:
        raise ValueError(f"unknown model {row.model!r}")
    t = jax.ShapeDtypeStruct((b,), f32)
    model = jax.tree.map(
        lambda leaf: (
            jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16)
            if jnp.issubdtype(leaf.dtype, jnp.floating)
            else leaf
        ),
        model,
    )
    return model, (x, t, cond)


def _velocity(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, t, cond))
    out: jax.Array = jax.vmap(model)(*bf16)
    return out.astype(jnp.float32)


def _loss(model: Any, x: Any, t: Any, cond: Any, target: Any) -> jax.Array:
    return jnp.mean(jnp.square(_velocity(model, x, t, cond) - target))


def _lora_policy(model: Any) -> Any:
    """Rank-32 adapters (alpha 64) on every attention projection, as the Flow-GRPO release."""
    from bench.scale import attention_layers

    return lora.add(
        model, LORA_RANK, key=jax.random.key(1), alpha=LORA_ALPHA, where=attention_layers
    )


def program(
    row: Row, mmdit_config: dict[str, Any] | None = None
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The row's function and its abstract arguments (`mmdit_config`: as `_build`'s)."""
    model, (x, t, cond) = _build(row, mmdit_config)
    target = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    precision = row.matmul_precision

    def scoped(function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if precision is None:
                return function(*args)
            with jax.default_matmul_precision(precision):
                return function(*args)

        return run

    if row.program == "train":

        def train(params: Any, x: Any, t: Any, cond: Any, target: Any) -> Any:
            return jax.value_and_grad(scoped(_loss))(params, x, t, cond, target)

        return train, (model, x, t, cond, target)
    optimizer = optax.adamw(1e-5, weight_decay=1e-4)
    if row.program == "adamw_full":
        params = model
        opt_state = jax.eval_shape(optimizer.init, params)

        def full(params: Any, opt_state: Any, x: Any, t: Any, cond: Any, target: Any) -> Any:
            loss, grads = jax.value_and_grad(scoped(_loss))(params, x, t, cond, target)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return loss, optax.apply_updates(params, updates), opt_state

        return full, (params, opt_state, x, t, cond, target)
    policy = eqx.filter_eval_shape(_lora_policy, model)
    trainable, frozen = eqx.partition(policy, lora.adapter_filter(policy))
    trainable = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), trainable)
    opt_state = jax.eval_shape(optimizer.init, trainable)

    def adapters(
        trainable: Any, frozen: Any, opt_state: Any, x: Any, t: Any, cond: Any, target: Any
    ) -> Any:
        def loss(trainable: Any) -> jax.Array:
            return scoped(_loss)(eqx.combine(trainable, frozen), x, t, cond, target)

        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return value, optax.apply_updates(trainable, updates), opt_state

    return adapters, (trainable, frozen, opt_state, x, t, cond, target)


# Library functions whose products are not the architecture's matmuls: the query-key norm's
# block-diagonal 0/1 products compute a per-head mean square and spread it back.
NOT_MODEL_PRODUCTS = frozenset({"head_rms_norm"})


def model_flops(row: Row) -> float:
    """3 x the forward's matmul FLOPs (plain attention, no remat: the model's function), the
    products traced inside `NOT_MODEL_PRODUCTS` left out (0.3 of SD3.5-Medium's 58.9 TFLOP a
    step), whatever the default matmul precision."""
    plain = dataclasses.replace(row, remat=None, attention="xla", program="train")
    model, (x, t, cond) = _build(plain)
    jaxpr = jax.make_jaxpr(_velocity)(model, x, t, cond).jaxpr
    return 3.0 * dot_flops(dot_generals(jaxpr, leaving_out=NOT_MODEL_PRODUCTS))


def random_arguments(tree: Any) -> Any:
    """Random arrays for an abstract tree (bfloat16 weights around 0.02, inputs normal)."""
    leaves, treedef = jax.tree.flatten(tree)

    @jax.jit
    def make() -> list[jax.Array]:
        out = []
        for index, leaf in enumerate(leaves):
            key = jax.random.key(index)
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                out.append((0.02 * jax.random.normal(key, leaf.shape)).astype(leaf.dtype))
            else:
                out.append(jnp.zeros(leaf.shape, leaf.dtype))
        return out

    return jax.tree.unflatten(treedef, make())


def plan_gib(memory: Any) -> dict[str, float]:
    """A compiled program's memory plan in GiB, to two decimals.

    **Arguments:**

    - `memory`: the program's `Compiled.memory_analysis()`.

    **Returns:**

    `arguments`, `temporaries`, `outputs` and `aliased` (the bytes of outputs that reuse an
    argument's buffer) as the compiler plans them, and `peak`, the compiler's own count of the
    most bytes live at once over the program (`peak_memory_in_bytes`), which can be less than
    the parts' sum.
    """
    gib = 2**30
    return {
        "arguments": round(memory.argument_size_in_bytes / gib, 2),
        "temporaries": round(memory.temp_size_in_bytes / gib, 2),
        "outputs": round(memory.output_size_in_bytes / gib, 2),
        "aliased": round(memory.alias_size_in_bytes / gib, 2),
        "peak": round(memory.peak_memory_in_bytes / gib, 2),
    }


def _peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else int(peak)


def device_peak_tflops(device: jax.Device) -> float:
    """The device kind's published bf16 peak (`PEAK_TFLOPS`), or for a kind not listed what a
    large bf16 matmul reaches on it (`matmul_tflops`)."""
    return PEAK_TFLOPS.get(device.device_kind, 0.0) or matmul_tflops()


def matmul_tflops(size: int = 8192, calls: int = 10) -> float:
    """A `size`-cubed bf16 matmul's TFLOP/s on this device (mean of `calls`)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(matmul(a, b))
    started = time.perf_counter()
    for _ in range(calls):
        out = matmul(a, b)
    jax.block_until_ready(out)
    return 2 * size**3 * calls / (time.perf_counter() - started) / 1e12


def measure(
    row: Row,
    calls: int,
    sharding: Any = None,
    peak: float = 197.0,
    profile_folder: str | None = None,
) -> dict[str, Any]:
    """Compile the row (for `sharding`'s device when given: ahead of time, nothing run), time
    it, and with `profile_folder` trace three more calls there (`jax.profiler`)."""
    function, args = program(row)
    result: dict[str, Any] = {"row": dataclasses.asdict(row)}
    flops = model_flops(row)
    result["model_tflop_per_step"] = round(flops / 1e12, 3)
    abstract = args
    if sharding is not None:
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
        )
    started = time.perf_counter()
    try:
        compiled = jax.jit(function).lower(*abstract).compile()
    except Exception as error:  # noqa: BLE001 - a plan that does not fit is a result
        result["error"] = " ".join(str(error).split())[:400]
        log(f"{row.name}: does not compile: {result['error'][:200]}")
        return result
    result["compile_seconds"] = round(time.perf_counter() - started, 1)
    result["plan_gib"] = plan_gib(compiled.memory_analysis())
    if sharding is not None:
        log(f"{row.name}: {json.dumps(result)}")
        return result
    concrete = random_arguments(args)
    jax.block_until_ready(compiled(*concrete))  # type: ignore[no-untyped-call]
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*concrete))  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - started)
    seconds = float(np.median(times))
    result["ms"] = round(1e3 * seconds, 1)
    result["ms_all"] = [round(1e3 * s, 1) for s in times]
    result["mfu"] = round(flops / seconds / (peak * 1e12), 4)
    result["peak_memory_gib"] = None if (m := _peak_memory()) is None else round(m / 2**30, 2)
    if profile_folder is not None:
        try:
            with jax.profiler.trace(profile_folder):
                for _ in range(3):
                    jax.block_until_ready(compiled(*concrete))  # type: ignore[no-untyped-call]
            result["profile"] = summarise_trace(profile_folder, 3, compiled.as_text())
        except Exception as error:  # noqa: BLE001 - the timing stands without the profile
            result["profile"] = f"failed: {error}"
    log(f"{row.name}: {json.dumps(result)}")
    del concrete
    return result


def fusions_with_products(hlo_text: str) -> set[str]:
    """The names of the instructions of a compiled XLA program (`Compiled.as_text()`) that
    compute a matrix product: a `convolution` or `dot`, or a fusion whose computation holds
    one (at any depth).

    On a TPU, XLA fuses a product with what consumes its result (a bias, a residual, the next
    layer norm's statistics) and names the fusion after the fusion's root, so that
    `convert_reduce_fusion.15` can be mostly a matmul; the profile's kinds go by this set,
    not by names alone.

    **Arguments:**

    - `hlo_text`: the program's text.

    **Returns:**

    The instruction names (without the leading `%`).
    """
    import re

    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.-]+) \(.*\) -> .*\{$", line)
        if header is not None:
            current = header.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    product = re.compile(r" (convolution|dot)\(")
    holds: dict[str, bool] = {}

    def holds_product(computation: str) -> bool:
        if computation not in holds:
            holds[computation] = False  # a cycle cannot occur; this ends any recursion
            lines = bodies.get(computation, [])
            holds[computation] = any(product.search(line) for line in lines) or any(
                holds_product(called)
                for line in lines
                for called in re.findall(r"calls=%([\w.-]+)", line)
            )
        return holds[computation]

    found = set()
    for lines in bodies.values():
        for line in lines:
            instruction = re.match(r"^\s*(?:ROOT )?%([\w.-]+) = ", line)
            if instruction is None:
                continue
            called = re.findall(r"calls=%([\w.-]+)", line)
            if product.search(line) or any(holds_product(c) for c in called):
                found.add(instruction.group(1))
    return found


def thread_names(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    """The name of each thread (by process and thread id) of a `jax.profiler` trace's events."""
    return {
        (e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def device_ops(events: list[dict[str, Any]], calls: int) -> dict[str, tuple[float, float]]:
    """Each XLA op on the device's threads (`XLA Ops`) of a `jax.profiler` trace's events over
    `calls` steps: its device milliseconds per step and its runs per step."""
    threads = thread_names(events)
    ms: dict[str, float] = {}
    runs: dict[str, int] = {}
    for event in events:
        thread = threads.get((event.get("pid"), event.get("tid")), "")
        if event.get("ph") == "X" and "XLA Ops" in thread:
            op = str(event.get("name"))
            ms[op] = ms.get(op, 0.0) + float(event.get("dur", 0.0)) / 1e3 / calls
            runs[op] = runs.get(op, 0) + 1
    return {op: (ms[op], runs[op] / calls) for op in ms}


def summarise_trace(folder: str, calls: int, program_text: str) -> dict[str, Any]:
    """A `jax.profiler` trace's device time per step, summed by kind of XLA op and by the
    function of the model that made the ops (`bench._op_sources.by_function`), the largest
    ops named.

    **Arguments:**

    - `folder`: where the trace of `calls` steps was written.
    - `calls`: how many steps it holds.
    - `program_text`: the compiled program's text (`Compiled.as_text()`): its fusions that
        hold a matrix product count as matmuls whatever their names say
        (`fusions_with_products`), and its metadata names each op's source line.

    **Returns:**

    The summary, a dict for the row's JSON.
    """
    import collections

    events = trace_events(folder)
    products = fusions_with_products(program_text)
    ops = collections.Counter({op: ms for op, (ms, _) in device_ops(events, calls).items()})
    kind_of = {name: op_kind(name, products) for name in ops}
    kinds: collections.Counter[str] = collections.Counter()
    loops: collections.Counter[str] = collections.Counter()
    for name, ms in ops.items():
        if kind_of[name] == LOOPS:
            loops[name] += ms
        else:
            kinds[kind_of[name]] += ms
    groups = summarise(
        [{"op": name, "ms": ms, "kind": kind_of[name]} for name, ms in ops.items()],
        instruction_metadata(program_text),
    )
    return {
        "device_ms_per_step_by_kind": {k: round(v, 2) for k, v in kinds.most_common()},
        "device_ms_per_step_of_kinds": round(sum(kinds.values()), 2),
        "device_ms_per_step_by_function": {
            function: round(ms, 2) for function, ms in by_function(groups)[:15]
        },
        "loops_ms_spanning_their_ops": {k: round(v, 2) for k, v in loops.most_common(10)},
        "largest_ops_ms": {name: round(ms, 2) for name, ms in ops.most_common(30)},
        "threads": sorted(set(thread_names(events).values()))[:20],
    }


def op_kind(name: str, products: set[str]) -> str:
    """The kind of a profiled XLA op, by `products` (the program's instructions that compute
    a matrix product) first, then by its name."""
    lowered = name.lower()
    if lowered.startswith(("while", "conditional")):
        return LOOPS
    if "splash" in lowered or "custom-call" in lowered or "mosaic" in lowered:
        return "fused attention (Pallas kernels)"
    if name in products:
        return "matmuls (and what XLA fused with them)"
    if "convolution" in lowered or "dot" in lowered or "matmul" in lowered:
        return "matmuls (and what XLA fused with them)"
    if "all-" in lowered or "reduce-scatter" in lowered or "collective" in lowered:
        return "collectives"
    if "copy" in lowered or "transpose" in lowered:
        return "copies and transposes"
    if "reduce" in lowered:
        return "reductions"
    if "fusion" in lowered:
        return "elementwise fusions"
    return "other"


SD35_MEDIUM_DEPTH = MMDiT.sd35_medium_config()["depth"]
WAN_1_3B_DEPTH = Wan.t2v_1_3b_config()["depth"]


_UNSTACKED_TWINS = ("sd35m b8 splash dots12", "wan1.3b 480x832x33 b1 dots12")
"""The rows that also run with their blocks one module each (`<name> unstacked`)."""


def first_blocks(saving: str, blocks: int, rest: str, depth: int) -> tuple[str, ...]:
    """A remat per block: `saving` in the first `blocks` of `depth` blocks, `rest` after."""
    return (saving,) * blocks + (rest,) * (depth - blocks)


def rows(which: str) -> list[Row]:
    """The rows of `--full-size` (`which`: `all`, or a comma-separated list of row names).

    `dotsK` rows save the products (`"dots"`) of the first K blocks and recompute the rest
    (`"nothing"`); `attentionK` LoRA rows save attention (`"attention"`) in the first K and
    the products in the rest. Rows are stacked (a scan per run of blocks) but those named
    `unstacked`, whose blocks are one module each in a Python loop: saved products then stay
    one buffer per block rather than slices of a stacked one.
    """
    table = [
        Row("sd35m b4 xla nothing", "sd35_medium", 4, "nothing", "xla"),
        Row("sd35m b8 splash nothing", "sd35_medium", 8, "nothing", "splash"),
        Row("sd35m b8 splash qkv", "sd35_medium", 8, "qkv", "splash"),
        Row("sd35m b8 splash attention", "sd35_medium", 8, "attention", "splash"),
        Row("sd35m b8 splash dots", "sd35_medium", 8, "dots", "splash"),
        Row("sd35m b8 splash256 nothing", "sd35_medium", 8, "nothing", "splash", 256),
        Row("sd35m b8 splash768 nothing", "sd35_medium", 8, "nothing", "splash", 768),
        Row("sd35m b16 splash nothing", "sd35_medium", 16, "nothing", "splash"),
        *(
            Row(
                f"sd35m b8 splash dots{k}",
                "sd35_medium",
                8,
                first_blocks("dots", k, "nothing", SD35_MEDIUM_DEPTH),
                "splash",
            )
            for k in (6, 8, 10, 12, 14, 16)
        ),
        Row("sd35m b16 splash attention", "sd35_medium", 16, "attention", "splash"),
        Row(
            "sd35m b8 splash nothing highest",
            "sd35_medium",
            8,
            "nothing",
            "splash",
            matmul_precision="highest",
        ),  # fmt: skip
        Row(
            "sd35m b8 lora32 adamw", "sd35_medium", 8, "nothing", "splash", program="adamw_lora"
        ),  # fmt: skip
        *(
            Row(
                f"sd35m b8 lora32 adamw {remat}",
                "sd35_medium",
                8,
                remat,
                "splash",
                program="adamw_lora",
            )
            for remat in ("qkv", "attention", "dots")
        ),
        *(
            Row(
                f"sd35m b8 lora32 adamw attention{k}",
                "sd35_medium",
                8,
                first_blocks("attention", k, "dots", SD35_MEDIUM_DEPTH),
                "splash",
                program="adamw_lora",
            )
            for k in (8, 12, 16)
        ),
        Row(
            "sd35m b8 full adamw", "sd35_medium", 8, "nothing", "splash", program="adamw_full"
        ),  # fmt: skip
        Row(
            "flux-dev 1024 b2 d4s8",
            "flux_dev",
            2,
            "nothing",
            "splash",
            flux_blocks=(4, 8),
            resolution=1024,
        ),  # fmt: skip
        Row("wan1.3b 480x832x33 b1", "wan_1_3b", 1, "nothing", "splash"),
        *(
            Row(
                f"wan1.3b 480x832x33 b1 dots{k}",
                "wan_1_3b",
                1,
                first_blocks("dots", k, "nothing", WAN_1_3B_DEPTH),
                "splash",
            )
            for k in (8, 10, 12, 14, 16)
        ),
    ]
    table += [
        dataclasses.replace(row, name=f"{row.name} unstacked", stacked=False)
        for row in table
        if row.name in _UNSTACKED_TWINS
    ]
    if which == "all":
        return table
    wanted = [name.strip() for name in which.split(",")]
    known = {row.name: row for row in table}
    missing = [name for name in wanted if name not in known]
    if missing:
        raise ValueError(f"unknown rows {missing}; known: {list(known)}")
    return [known[name] for name in wanted]


def run(which: str, calls: int, topology: str | None, profile: str | None) -> dict[str, Any]:
    """Every chosen row, on this device or compiled for `topology`."""
    report: dict[str, Any] = {"jax": jax.__version__}
    sharding = None
    peak = 197.0
    if topology is not None:
        from jax.experimental import topologies

        names = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1"}
        described = topologies.get_topology_desc(platform="tpu", topology_name=names[topology])
        device = described.devices[0]
        mesh = jax.sharding.Mesh(np.array([device]), ("one",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        report["compiled_for"] = f"{device.device_kind} (one chip, ahead of time)"
    else:
        device = jax.devices()[0]
        peak = device_peak_tflops(device)
        report["device"] = device.device_kind
        report["peak_tflops"] = peak
        report["matmul_tflops_8192"] = round(matmul_tflops(), 1)
    import tempfile

    report["rows"] = []
    for row in rows(which):
        folder = None
        if profile is not None and row.name == profile and topology is None:
            folder = tempfile.mkdtemp(prefix="flowgrpo-profile-")
        report["rows"].append(measure(row, calls, sharding, peak, folder))
    return report
