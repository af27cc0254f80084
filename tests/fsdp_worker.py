"""`python -m tests.fsdp_worker` with 4 simulated devices: one device replicated vs 4 with FSDP.

Run by `tests/test_fsdp.py` in a fresh interpreter (the device count is fixed at JAX's start);
prints one JSON object with a report for each model: both runs' metrics, the largest parameter
difference and how the FSDP state lies on the devices. `mlp`: the MLP velocity; `mmdit`: a
small stacked `MMDiT` with CFG and a KL reference, and the all-gathers of the compiled FSDP
step, split into weights and activations.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.train import Trainer, minibatch_indices


ROWS, TRANSITIONS, LATENT, COND = 8, 3, 8, 3
UPDATES = 3
MIN_ELEMENTS = 256


def make_batch(objective, variables):
    """Transitions on the objective's grid whose recorded log densities are a perturbed
    policy's, so that ratios move away from 1 and some clip."""
    rng = np.random.default_rng(0)
    grid = np.asarray(fg.RectifiedFlow().timesteps(TRANSITIONS + 1))
    t = np.broadcast_to(grid[:-1], (ROWS, TRANSITIONS)).astype(np.float32)
    t_next = np.broadcast_to(grid[1:], (ROWS, TRANSITIONS)).astype(np.float32)
    latents = rng.normal(size=(ROWS, TRANSITIONS, LATENT)).astype(np.float32)
    batch = fg.Transitions(
        latents=jnp.asarray(latents),
        next_latents=jnp.asarray(latents + 0.3 * rng.normal(size=latents.shape), jnp.float32),
        timesteps=jnp.asarray(t),
        next_timesteps=jnp.asarray(t_next),
        old_log_probs=jnp.zeros((ROWS, TRANSITIONS), jnp.float32),
        transition_mask=jnp.asarray(rng.random((ROWS, TRANSITIONS)) < 0.8),
        advantages=jnp.asarray(rng.normal(size=ROWS), jnp.float32),
        cond=jnp.asarray(rng.normal(size=(ROWS, COND)), jnp.float32),
    )
    old = objective.log_probs(variables, batch)
    noise = jnp.asarray(0.2 * rng.normal(size=old.shape), jnp.float32)
    return eqx.tree_at(lambda b: b.old_log_probs, batch, old + noise)


def train(trainer, state, batch):
    history = []
    for _ in range(UPDATES):
        state, metrics = trainer.update(state, batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return state, history


def on_one_and_four(trainer, host_state, host_batch):
    """The updates on one device with replicated parameters (the state and metrics after
    them), and the FSDP start on four devices with the rows sharded over them."""
    one = fg.data_mesh(1)
    replicated_state, replicated = train(
        trainer,
        fg.shard_parameters(host_state, one, "replicated"),
        fg.shard_batch(host_batch, one),
    )
    four = fg.data_mesh(4)
    sharded_start = fg.shard_parameters(host_state, four, "fsdp", min_elements=MIN_ELEMENTS)
    return replicated_state, replicated, sharded_start, fg.shard_batch(host_batch, four)


def largest_difference(a, b):
    """The largest absolute difference between two trees' floating-point arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(
            jax.tree.leaves(eqx.filter(a, eqx.is_inexact_array)),
            jax.tree.leaves(eqx.filter(b, eqx.is_inexact_array)),
            strict=True,
        )
    )


def mlp_report():
    model = MLPVelocity(LATENT, COND, hidden=64, depth=2, key=jax.random.key(0))
    objective = fg.FlowGRPOObjective(
        model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.1, clip_range=0.2
    )
    trainer = Trainer(objective)
    initial = trainer.init(jax.random.key(1))
    batch = make_batch(objective, initial.variables)
    host_state = jax.device_get(initial)
    host_batch = jax.device_get(batch)

    replicated_state, replicated, sharded_start, four_rows = on_one_and_four(
        trainer, host_state, host_batch
    )
    sharded_state, sharded = train(trainer, sharded_start, four_rows)
    moved = largest_difference(host_state.variables.policy, replicated_state.variables.policy)
    difference = largest_difference(replicated_state, sharded_state)
    # bfloat16 with the old log densities taken from the update's program, on the FSDP mesh:
    # the first update's ratio is exactly 1 there too.
    bfloat16_objective = fg.FlowGRPOObjective(
        model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, beta=0.1,
        clip_range=0.2, precision="bfloat16", old_log_probs="update",
    )  # fmt: skip
    bfloat16 = Trainer(bfloat16_objective)
    bfloat16_state = fg.shard_parameters(
        host_state, fg.data_mesh(4), "fsdp", min_elements=MIN_ELEMENTS
    )
    rescored = bfloat16.rescore(
        bfloat16_state,
        fg.Rescore(four_rows, fill=bfloat16_objective.with_rescored_rows),
        minibatch_indices(ROWS, ROWS, jax.random.key(3)),
    )
    _, first = bfloat16.update(bfloat16_state, rescored)
    large = [
        leaf
        for part in (
            sharded_state.variables.policy,
            sharded_state.variables.reference,
            sharded_state.opt_state,
        )
        for leaf in jax.tree.leaves(eqx.filter(part, eqx.is_inexact_array))
        if leaf.size >= MIN_ELEMENTS
    ]
    return {
        "bfloat16_first_update": {name: float(v) for name, v in first.items()},
        "replicated": replicated,
        "fsdp": sharded,
        "moved": moved,
        "largest_difference": difference,
        "large_arrays": len(large),
        "large_sharded": sum(
            not leaf.sharding.is_fully_replicated
            and leaf.addressable_shards[0].data.size * 4 == leaf.size
            for leaf in large
        ),
        "device_fraction": fg.device_fraction((sharded_state.variables, sharded_state.opt_state)),
    }


def weight_shapes(tree):
    """Every shape a gathered weight can have: whole, one layer of a stack, transposed."""
    shapes = set()
    for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)):
        shape = tuple(leaf.shape)
        for form in (shape, shape[1:], (1, *shape[1:])):
            shapes.add(form)
            shapes.add(tuple(reversed(form)))
            if len(form) == 3:
                shapes.add((form[0], form[2], form[1]))
    return shapes


def all_gathers(hlo_text, shapes):
    """`(weights, activations)`: the all-gathers of a compiled HLO text, by result shape."""
    found = re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo_text)
    results = [tuple(int(size) for size in dims.split(",") if size) for dims in found]
    activations = [shape for shape in results if shape not in shapes]
    return len(results) - len(activations), activations


def mmdit_report():
    from flowgrpo_eqx.models import MMDiT, SaveDots
    from flowgrpo_eqx.train._trainer import _mesh_context, _update_donating

    rows = 8
    sizes = dict(image_size=8, channels=4, patch=2, width=32, heads=4, context_length=3)
    sizes.update(context_dim=12, pooled_dim=16, depth=3, qk_norm="rms_norm")
    model = MMDiT(**sizes, remat=SaveDots(), key=jax.random.key(0))
    rng = np.random.default_rng(0)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.tree.map(
        lambda p: p + jax.device_put((0.05 * rng.standard_normal(p.shape)).astype(p.dtype)),
        params,
    )
    model = eqx.combine(params, static)
    null = {"context": np.zeros((3, 12), np.float32), "pooled": np.zeros((16,), np.float32)}
    objective = fg.FlowGRPOObjective(
        model, fg.RectifiedFlow(),
        fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=(8, 8, 4)),
        guidance=fg.CFG(4.5), beta=0.04, clip_range=0.2, steps=3,
    )  # fmt: skip
    trainer = Trainer(objective)
    latents = rng.standard_normal((rows, 1, 8, 8, 4)).astype(np.float32)
    batch = fg.Transitions(
        latents=latents,
        next_latents=latents + 0.3 * rng.standard_normal(latents.shape).astype(np.float32),
        timesteps=np.full((rows, 1), 0.75, np.float32),
        next_timesteps=np.full((rows, 1), 0.5, np.float32),
        old_log_probs=np.zeros((rows, 1), np.float32),
        transition_mask=np.ones((rows, 1), bool),
        advantages=rng.standard_normal(rows).astype(np.float32),
        cond={
            "context": rng.standard_normal((rows, 3, 12)).astype(np.float32),
            "pooled": rng.standard_normal((rows, 16)).astype(np.float32),
        },
    )
    initial = trainer.init(jax.random.key(1))
    old = objective.log_probs(initial.variables, batch)
    batch = eqx.tree_at(lambda b: b.old_log_probs, batch, old + 0.05)
    host_state, host_batch = jax.device_get(initial), jax.device_get(batch)

    replicated_state, replicated, sharded_start, four_rows = on_one_and_four(
        trainer, host_state, host_batch
    )
    # The compiled step: `Trainer.update`'s own program, which the updates below then reuse.
    with _mesh_context(sharded_start):
        lowered = _update_donating.lower((trainer, four_rows, True), sharded_start)
        hlo = lowered.compile().compiled.as_text()
    weights, activations = all_gathers(hlo, weight_shapes(initial))
    sharded_state, sharded = train(trainer, sharded_start, four_rows)
    difference = largest_difference(replicated_state, sharded_state)
    moved = largest_difference(host_state.variables.policy, replicated_state.variables.policy)
    return {
        "replicated": replicated,
        "fsdp": sharded,
        "moved": moved,
        "largest_difference": difference,
        "weight_gathers": weights,
        "activation_gathers": [list(shape) for shape in activations],
        "reduce_scatters": len(re.findall(r" reduce-scatter\(", hlo)),
        "device_fraction": fg.device_fraction((sharded_state.variables, sharded_state.opt_state)),
    }


if __name__ == "__main__":
    print(json.dumps({"mlp": mlp_report(), "mmdit": mmdit_report()}))
