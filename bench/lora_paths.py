"""`python -m bench.lora_paths`: what a LoRA training step costs when the adapters are folded
into the weights (`flowgrpo_eqx.lora`, `W + s b a` at each call) against computing them beside
each layer (`W x + s b (a x)`), with a full fine-tune and the forward pass alone beside them.

The model is a stack of `--layers` `eqx.nn.Linear(width, width)` layers with a GELU between,
called on one token and vmapped over `--tokens` tokens, with a rank-`--rank` adapter on every
layer. Each variant is the jitted value and gradient of a mean-square loss: with respect to
every weight (`full`), to the adapters of a `lora.add` model (`folded`), or to the adapters
of a per-layer model written here (`per_layer`); `forward` is the loss alone. Before timing,
the folded and per-layer adapter gradients are compared (they are the same function).
Timing interleaves the variants (`bench._timing.interleave`) and reports each one's median
milliseconds and its ratio to `full`, taken per round; XLA's cost analysis gives each compiled
program's FLOPs, which show whether the compiler reassociated the folded gradient. Prints one
JSON object on stdout, progress on stderr.
"""

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from bench._measure import xla_flops
from bench._timing import interleave, log
from flowgrpo_eqx import lora


def _through(layers: list[Callable[[Array], Array]], x: Array) -> Array:
    """`x` through `layers` in turn, with a GELU after each but the last."""
    for index, layer in enumerate(layers):
        x = layer(x)
        if index < len(layers) - 1:
            x = jax.nn.gelu(x)
    return x


class LinearStack(eqx.Module):
    """`layers` square linear layers with a GELU after each but the last, on one token."""

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, width: int, depth: int, dtype: Any, *, key: PRNGKeyArray) -> None:
        keys = jax.random.split(key, depth)
        self.layers = tuple(eqx.nn.Linear(width, width, dtype=dtype, key=k) for k in keys)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " width"]:
        return _through(list(self.layers), x)


class PerLayerStack(eqx.Module):
    """The same stack with each layer computing `W x + bias + scale * b (a x)`."""

    base: LinearStack
    adapters: tuple[lora.LoraAdapter, ...]
    scale: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " width"]:
        def adapted(layer: eqx.nn.Linear, adapter: lora.LoraAdapter) -> Callable[[Array], Array]:
            return lambda x: layer(x) + (self.scale * (adapter.b @ (adapter.a @ x))).astype(x.dtype)

        pairs = zip(self.base.layers, self.adapters, strict=True)
        return _through([adapted(layer, adapter) for layer, adapter in pairs], x)


def _loss(model: Callable[[Array], Array], tokens: Array, target: Array) -> Array:
    out = jax.vmap(model)(tokens)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - target))


def _value_and_grad(model: Any, trainable: Any) -> tuple[Callable[..., Any], Any, Any]:
    """A jitted `(trained, frozen, tokens, target) -> (loss, grads)` and the two parts."""
    trained, frozen = eqx.partition(model, trainable)

    @jax.jit
    def step(trained: Any, frozen: Any, tokens: Array, target: Array) -> Any:
        def loss(part: Any) -> Array:
            return _loss(eqx.combine(part, frozen), tokens, target)

        return jax.value_and_grad(loss)(trained)

    return step, trained, frozen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_paths", description=__doc__)
    parser.add_argument("--width", type=int, default=1536, help="layer width (SD3.5-Medium's)")
    parser.add_argument("--layers", type=int, default=8, help="linear layers in the stack")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    parser.add_argument("--rank", type=int, default=32, help="adapter rank")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds")
    args = parser.parse_args(argv)
    for name in ("width", "layers", "tokens", "rank", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    dtype = jnp.dtype(args.dtype)
    model_key, adapter_key, b_key, data_key, target_key = jax.random.split(jax.random.key(0), 5)
    base = LinearStack(args.width, args.layers, dtype, key=model_key)
    folded = lora.add(base, args.rank, key=adapter_key)
    # Trained adapters, not fresh ones (b = 0): the same work, but a gradient check that means
    # something.
    b_keys = jax.random.split(b_key, args.layers)
    adapters = tuple(
        eqx.tree_at(
            lambda adapter: adapter.b,
            adapter,
            (0.02 * jax.random.normal(k, adapter.b.shape)).astype(dtype),
        )
        for adapter, k in zip(folded.adapters, b_keys, strict=True)
    )
    folded = eqx.tree_at(lambda model: model.adapters, folded, adapters)
    per_layer = PerLayerStack(base, adapters, folded.alpha / folded.rank)
    tokens = jax.random.normal(data_key, (args.tokens, args.width)).astype(dtype)
    target = jax.random.normal(target_key, (args.tokens, args.width), jnp.float32)

    per_layer_filter = eqx.tree_at(
        lambda model: model.adapters,
        jax.tree.map(lambda _: False, per_layer),
        tuple(jax.tree.map(lambda _: True, adapter) for adapter in adapters),
    )
    steps = {
        "full": _value_and_grad(base, eqx.is_inexact_array),
        "folded": _value_and_grad(folded, lora.adapter_filter(folded)),
        "per_layer": _value_and_grad(per_layer, per_layer_filter),
    }
    log(f"compiling ({args.layers} x Linear({args.width}), {args.tokens} tokens, {dtype})")
    # Each program is compiled once: the FLOPs, the gradient check and the timing use it.
    arguments = {
        name: (trained, frozen, tokens, target) for name, (_, trained, frozen) in steps.items()
    }
    compiled = {name: step.lower(*arguments[name]).compile() for name, (step, *_) in steps.items()}
    arguments["forward"] = (base, tokens, target)
    compiled["forward"] = jax.jit(_loss).lower(*arguments["forward"]).compile()
    flops = {name: xla_flops(program) for name, program in compiled.items()}
    variants = {
        name: functools.partial(program, *arguments[name]) for name, program in compiled.items()
    }

    folded_grads = variants["folded"]()[1].adapters
    per_layer_grads = variants["per_layer"]()[1].adapters
    worst = 0.0
    for f, p in zip(jax.tree.leaves(folded_grads), jax.tree.leaves(per_layer_grads), strict=True):
        f64, p64 = np.asarray(f, np.float64), np.asarray(p, np.float64)
        worst = max(worst, float(np.max(np.abs(f64 - p64)) / (np.max(np.abs(p64)) + 1e-30)))
    log(f"folded and per-layer adapter gradients differ by at most {worst:.2e} of their scale")

    log(f"timing {args.rounds} rounds")
    timings = interleave(variants, args.rounds)
    report = {
        "machine": jax.devices()[0].device_kind,
        "config": vars(args),
        "median_ms": {
            name: 1e3 * float(np.median(seconds)) for name, seconds in timings.wall.items()
        },
        "ratio_to_full": {
            name: float(np.median(timings.per_round(name, "full"))) for name in variants
        },
        "xla_flops": flops,
        "analytic_matmul_flops": {
            "forward": 2 * args.tokens * args.layers * args.width**2,
            "full": 6 * args.tokens * args.layers * args.width**2,
        },
        "adapter_gradient_relative_difference": worst,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
