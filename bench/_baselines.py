"""The bare work the library's figures are compared with: a large matmul, and the model passes.

The model baselines call the same model on the same inputs as the library, with nothing
else: no SDE arithmetic, masking, statistics, clipping, optimizer or scan bookkeeping.
They are plain `jax.jit` functions of arrays (the model's static parts are closed over), so
their dispatch is as cheap as JAX allows.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg


MATMUL_SIZE = 2048


def matmul_baseline(size: int = MATMUL_SIZE) -> tuple[Callable[[], Any], float]:
    """A `size x size @ size x size` float32 matmul and its FLOPs (`2 size^3`)."""
    keys = jax.random.split(jax.random.key(1234))
    a = jax.random.normal(keys[0], (size, size), jnp.float32)
    b = jax.random.normal(keys[1], (size, size), jnp.float32)
    product = jax.jit(jnp.matmul)
    return (lambda: product(a, b)), float(2 * size**3)


def shaped_matmuls(
    layer_dims: list[tuple[int, int]], rows: int, reference: bool
) -> tuple[Callable[[], Any], float]:
    """Only the matmuls of a training step of a dense-layer model, at the step's shapes.

    For each layer `(in, out)` on `rows` inputs: the forward `[rows, in] @ [in, out]`, the
    weight gradient `[in, rows] @ [rows, out]` and (except the first layer) the input
    gradient `[rows, out] @ [out, in]`; with `reference`, a second forward. No activations,
    biases or anything else. Returns the call and its FLOPs.
    """
    key = jax.random.key(4321)
    arrays = []
    flops = 0
    for index, (fan_in, fan_out) in enumerate(layer_dims):
        k1, k2, k3, key = jax.random.split(key, 4)
        x = jax.random.normal(k1, (rows, fan_in), jnp.float32)
        w = jax.random.normal(k2, (fan_in, fan_out), jnp.float32)
        g = jax.random.normal(k3, (rows, fan_out), jnp.float32)
        arrays.append((x, w, g))
        passes = (2 if index > 0 else 1) + 1 + (1 if reference else 0)
        flops += 2 * rows * fan_in * fan_out * passes

    def run(arrays: Any) -> Any:
        out = []
        for index, (x, w, g) in enumerate(arrays):
            out.append(x @ w)
            out.append(x.T @ g)
            if index > 0:
                out.append(g @ w.T)
            if reference:
                out.append((x + 1.0) @ w)
        return out

    compiled = jax.jit(run).lower(arrays).compile()
    return (lambda: compiled(arrays)), float(flops)


def _guided(
    flow: fg.GuidedFlow, x: jax.Array, t: jax.Array, rows: Any
) -> tuple[jax.Array, jax.Array, Any]:
    """The model batch of one guided evaluation: both CFG branches stacked, as the library."""
    conditioning = flow.inputs.condition(rows)
    if flow.guidance is None:
        return x, t, conditioning
    null = flow.inputs.null_condition(x.shape[0])
    both = jax.tree.map(
        lambda c, u: jnp.concatenate([c, u.astype(c.dtype)], axis=0), conditioning, null
    )
    return jnp.concatenate([x, x]), jnp.concatenate([t, t]), both


def flat_transitions(batch: fg.Transitions) -> tuple[jax.Array, jax.Array, Any]:
    """The `N K` recorded transitions as one batch: `x [K N, *latent]`, `t [K N]`, rows."""
    n, k = batch.timesteps.shape
    x = jnp.swapaxes(batch.latents, 0, 1).reshape(k * n, *batch.latents.shape[2:])
    t = jnp.swapaxes(batch.timesteps, 0, 1).reshape(k * n)
    rows = jax.tree.map(lambda leaf: jnp.concatenate([leaf] * k, axis=0), batch.cond)
    return x, t, rows


def model_work(
    objective: fg.FlowGRPOObjective, variables: fg.FlowGRPOVariables, batch: fg.Transitions
) -> tuple[Callable[[], Any], jax.stages.Compiled]:
    """Value and gradient of the policy over the step's 2NK guided inputs, plus (beta > 0)
    the reference's forward over the same inputs.

    The scalar is the model outputs contracted with a fixed random cotangent, so the
    backward pass is a full one. Returns the call and its compiled executable.
    """
    params, static = eqx.partition(variables.policy, eqx.is_inexact_array)
    reference, ref_static = eqx.partition(variables.reference, eqx.is_inexact_array)
    if objective.beta <= 0:
        reference = None
    x, t, rows = flat_transitions(batch)
    model_x, _, _ = _guided(objective.flow, x, t, rows)
    cotangent = jax.random.normal(jax.random.key(99), model_x.shape, jnp.float32)

    def work(params: Any, reference: Any, x: Any, t: Any, rows: Any, cotangent: Any) -> Any:
        mx, mt, mc = _guided(objective.flow, x, t, rows)

        def value(p: Any) -> jax.Array:
            out = jax.vmap(eqx.combine(p, static))(mx, mt, mc)
            return jnp.vdot(out.astype(jnp.float32), cotangent)

        total, grads = jax.value_and_grad(value)(params)
        if reference is not None:
            ref_out = jax.vmap(eqx.combine(reference, ref_static))(mx, mt, mc)
            total = total + jnp.vdot(ref_out.astype(jnp.float32), cotangent)
        return total, grads

    args = (params, reference, x, t, rows, cotangent)
    jitted = jax.jit(work)
    compiled = jitted.lower(*args).compile()
    return (lambda: compiled(*args)), compiled


def model_rollout(
    rollout: fg.FlowRollout, policy: Any, device_rows: Any, batched_guidance: bool = True
) -> Callable[[], Any]:
    """(steps - 1) guided forwards over the N rows, chained by a plain Euler update; with
    guidance, both branches in one batched model call, or (`batched_guidance=False`) the
    conditional and the null branch in two calls."""
    flow = rollout.flow
    latent_shape = flow.inputs.latent_shape
    assert latent_shape is not None
    params, static = eqx.partition(policy, eqx.is_inexact_array)
    grid = rollout.timesteps()
    n = int(jax.tree.leaves(device_rows)[0].shape[0])
    start = jax.random.normal(jax.random.key(7), (n, *latent_shape), jnp.float32)

    def run(params: Any, start: Any, rows: Any) -> Any:
        model = eqx.combine(params, static)

        def body(x: jax.Array, times: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            t, t_next = times
            times_n = jnp.full((n,), t, x.dtype)
            if flow.guidance is not None and not batched_guidance:
                conditional = jax.vmap(model)(x, times_n, flow.inputs.condition(rows))
                null = jax.vmap(model)(x, times_n, flow.inputs.null_condition(n))
                v = flow.guidance.combine(conditional.astype(x.dtype), null.astype(x.dtype))
            else:
                mx, mt, mc = _guided(flow, x, times_n, rows)
                v = jax.vmap(model)(mx, mt, mc).astype(x.dtype)
                if flow.guidance is not None:
                    v = flow.guidance.combine(v[:n], v[n:])
            return x + (t_next - t) * v, None

        final, _ = jax.lax.scan(body, start, (grid[:-1], grid[1:]))
        return final

    jitted = jax.jit(run)
    compiled = jitted.lower(params, start, device_rows).compile()
    return lambda: compiled(params, start, device_rows)


def repeat_rows(rows: Any, groups: int) -> Any:
    """Source rows repeated per group, as `FlowRollout.collect` does, on the device."""
    return jax.tree.map(lambda leaf: jnp.asarray(np.repeat(np.asarray(leaf), groups, 0)), rows)
