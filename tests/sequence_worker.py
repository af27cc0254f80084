"""Run by `tests/test_sequence_parallel.py` on 4 simulated devices: sequence parallelism
against one device.

`python -m tests.sequence_worker models` prints one JSON line with `attention` and `models`,
`python -m tests.sequence_worker training FOLDER` one with `epoch` (checkpoints in FOLDER):

- `attention`: per strategy, sequence-parallel attention against `plain_attention`, values
    and each input's gradient; and the error of a sequence the axis does not divide.
- `models`: per model (`MMDiT` with one block, both SD3.5's dual attention and the last
    block's pre-only text stream; `Flux` with a double- and a single-stream block; `Wan`) and
    strategy, the velocity and every parameter's gradient on a `("data", "sequence")` mesh of
    `1 x 4` against one device without a mesh.
- `epoch`: one Flow-GRPO epoch (rollout and updates) of a LoRA-adapted MMDiT with CFG on one
    device, with Ulysses on a `2 x 2` mesh (FSDP), and with the ring on `1 x 4`; then the
    `2 x 2` state's checkpoint restored onto the `1 x 4` mesh, and a second epoch from it
    against the one-device second epoch.

Each difference is the largest absolute difference over the largest absolute value of the
one-device result (per array for gradients and parameters).
"""

import functools
import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.models import (
    SEQUENCE_STRATEGY_NAMES,
    ChunkedAttention,
    Flux,
    MMDiT,
    PlainAttention,
    RingSequence,
    UlyssesSequence,
    Wan,
    sequence_strategy_from_name,
)
from flowgrpo_eqx.models._attention_settings import AttentionSettings
from flowgrpo_eqx.models._layers import plain_attention
from flowgrpo_eqx.models._sequence import join_streams, part_streams, sequence_parallel_attention
from flowgrpo_eqx.train import Checkpointer, Trainer, default_optimizer, rl_epoch
from tests.tiny_models import perturbed


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    return float(np.max(np.abs(got - want)) / scale) if scale > 0 else float(np.max(np.abs(got)))


def largest_relative(got, want) -> float:
    """The largest `relative` over the floating-point arrays of two trees."""
    pairs = zip(
        jax.tree.leaves(eqx.filter(got, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(want, eqx.is_inexact_array)),
        strict=True,
    )
    return max(relative(a, b) for a, b in pairs)


def attention_report() -> dict:
    mesh = Mesh(np.array(jax.devices()), ("sequence",))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, (2, 24, 4, 8), jnp.float32) for key in keys)

    def objective(attention):
        return lambda q, k, v: jnp.vdot(jax.vmap(attention)(q, k, v), cotangent)

    want = jax.vmap(plain_attention)(q, k, v)
    want_grads = jax.grad(objective(plain_attention), argnums=(0, 1, 2))(q, k, v)
    report = {}
    # The chunked ring folds 4 of each device's 6 queries at a time (the last chunk padded).
    plain = AttentionSettings(PlainAttention())
    chunked = AttentionSettings(ChunkedAttention(4))
    cases = [
        ("ulysses", UlyssesSequence(), plain),
        ("ring", RingSequence(), plain),
        ("ring_chunked", RingSequence(), chunked),
    ]
    for name, strategy, settings in cases:

        def split(q, k, v, strategy=strategy, settings=settings):
            return sequence_parallel_attention(q, k, v, mesh, "sequence", strategy, settings)

        got = jax.jit(jax.vmap(split))(q, k, v)
        grads = jax.jit(jax.grad(objective(split), argnums=(0, 1, 2)))(q, k, v)
        report[name] = {
            "values": relative(got, want),
            "gradients": [relative(a, b) for a, b in zip(grads, want_grads, strict=True)],
        }
    try:
        sequence_parallel_attention(q[0, :6], k[0, :6], v[0, :6], mesh, "sequence", RingSequence())
    except ValueError as error:
        report["indivisible"] = str(error)
    return report


def text(key, rows: int, length: int = 8) -> dict:
    first, second = jax.random.split(key)
    return {
        "context": jax.random.normal(first, (rows, length, 32)),
        "pooled": jax.random.normal(second, (rows, 32)),
    }


def models_report() -> dict:
    # 4 heads, and image (or video) tokens that 4 divides: 16, 16 and 12.
    key = jax.random.key(0)
    models = {
        "mmdit": (
            MMDiT(8, patch=2, depth=1, width=64, heads=4, qk_norm="rms_norm",
                  dual_attention_layers=(0,), key=key),
            text, (8, 8, 4),
        ),
        "flux": (Flux(8, width=64, heads=4, axes_dims=(4, 6, 6), key=key), text, (8, 8, 4)),
        # 6 text tokens, which 4 devices do not divide: the single-stream block's text
        # stays whole beside the split image tokens.
        "flux_uneven_text": (
            Flux(8, width=64, heads=4, axes_dims=(4, 6, 6), context_length=6, key=key),
            functools.partial(text, length=6), (8, 8, 4),
        ),
        "wan": (
            Wan((3, 4, 4), width=64, heads=4, ffn_dim=96, depth=1, key=key),
            lambda key, rows: jax.random.normal(key, (rows, 8, 32)), (3, 4, 4, 4),
        ),
    }  # fmt: skip
    mesh = fg.data_mesh(4, sequence=4)
    report = {}
    for name, (model, conditions, shape) in models.items():
        model = perturbed(model, 1)
        keys = jax.random.split(jax.random.key(2), 4)
        x = jax.random.normal(keys[0], (2, *shape))
        t = jax.random.uniform(keys[1], (2,))
        cond = conditions(keys[2], 2)
        cotangent = jax.random.normal(keys[3], (2, *shape))

        @eqx.filter_jit
        @eqx.filter_value_and_grad(has_aux=True)
        def velocity_and_gradient(model, x, t, cond, cotangent=cotangent):
            velocity = jax.vmap(model)(x, t, cond)
            return jnp.vdot(velocity, cotangent), velocity

        (_, want), want_grads = velocity_and_gradient(model, x, t, cond)
        report[name] = {}
        for strategy in SEQUENCE_STRATEGY_NAMES:
            split = model.with_settings(sequence_strategy=sequence_strategy_from_name(strategy))
            with jax.set_mesh(mesh):
                (_, got), grads = velocity_and_gradient(split, x, t, cond)
            report[name][strategy] = {
                "values": relative(got, want),
                "gradients": largest_relative(grads, want_grads),
            }
    # In bfloat16 the text's gradient is summed over the axis; XLA's CPU backend aborted the
    # whole process on that sum in bfloat16 (so the text crosses in float32).
    flux = perturbed(models["flux"][0], 1)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, flux)
    keys = jax.random.split(jax.random.key(3), 3)
    x, t, cond = jax.random.normal(keys[0], (2, 8, 8, 4)), jnp.full((2,), 0.5), text(keys[1], 2)

    @eqx.filter_jit
    @eqx.filter_grad
    def half_gradient(model, x, t, cond):
        return jnp.sum(jax.vmap(model)(x, t, cond).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        grads = half_gradient(half, x, t, cond)
    report["bfloat16_gradient_finite"] = all(
        bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    )
    two_heads = MMDiT(8, patch=2, depth=2, width=64, heads=2, key=key)
    one_text = jax.tree.map(lambda c: c[0], text(key, 1))
    try:
        with jax.set_mesh(mesh):
            jax.eval_shape(two_heads, jnp.zeros((8, 8, 4)), jnp.zeros(()), one_text)
    except ValueError as error:
        report["heads_not_divisible"] = str(error)
    return report


ROWS, GROUPS, STEPS = 2, 2, 3
CONTEXT = dict(context_length=3, context_dim=12, pooled_dim=16)


def epoch_parts(strategy):
    """A LoRA-adapted MMDiT's Flow-GRPO objective with CFG, its trainer, the first state (on
    the host) and the source rows; the same arrays for either strategy."""
    base = MMDiT(
        8, patch=2, depth=1, width=32, heads=4, **CONTEXT,
        sequence_strategy=sequence_strategy_from_name(strategy),
        key=jax.random.key(0),
    )  # fmt: skip
    policy = lora.add(perturbed(base, 1), 2, key=jax.random.key(1), alpha=4.0)
    policy = eqx.tree_at(lambda p: p.adapters, policy, perturbed(policy.adapters, 2))
    null = {"context": np.zeros((3, 12), np.float32), "pooled": np.zeros((16,), np.float32)}
    inputs = fg.InputSpec(select=("context", "pooled"), null=null, latent_shape=(8, 8, 4))
    objective = fg.FlowGRPOObjective(
        policy, fg.RectifiedFlow(), inputs, guidance=fg.CFG(3.0), beta=0.04, clip_range=0.2,
        steps=STEPS,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rows = {
        "context": rng.standard_normal((ROWS, 3, 12)).astype(np.float32),
        "pooled": rng.standard_normal((ROWS, 16)).astype(np.float32),
    }
    trainer = Trainer(objective, default_optimizer(1e-2, 0.0))
    return objective, trainer, jax.device_get(trainer.init(jax.random.key(3))), rows


def brightness(samples, rows) -> np.ndarray:
    return np.mean(np.asarray(samples, np.float64), axis=(1, 2, 3))


def epoch_report(folder: pathlib.Path) -> dict:
    parts = {strategy: epoch_parts(strategy) for strategy in SEQUENCE_STRATEGY_NAMES}

    def epoch(state, mesh, strategy, number):
        objective, trainer, _, rows = parts[strategy]
        rollout = fg.FlowRollout(objective, brightness, groups=GROUPS, steps=STEPS, mesh=mesh)
        state, metrics, _ = rl_epoch(trainer, state, rollout, rows, jax.random.key(10 + number))
        return state, metrics

    def placed(strategy, mesh, sharding):
        return fg.shard_parameters(parts[strategy][2], mesh, sharding, min_elements=256)

    one = fg.data_mesh(1)
    by_two, by_four = fg.data_mesh(4, sequence=2), fg.data_mesh(4, sequence=4)
    want, want_metrics = epoch(placed("ulysses", one, "replicated"), None, "ulysses", 1)
    ulysses, ulysses_metrics = epoch(placed("ulysses", by_two, "fsdp"), by_two, "ulysses", 1)
    ring, ring_metrics = epoch(placed("ring", by_four, "replicated"), by_four, "ring", 1)
    checkpoints = Checkpointer(folder / "checkpoints")
    checkpoints.save(1, ulysses, {"mesh": dict(by_two.shape)})
    like = placed("ring", by_four, "replicated")
    restored, _ = checkpoints.restore(like)
    restored_meshes = {
        tuple(leaf.sharding.mesh.shape.items())
        for leaf in jax.tree.leaves(restored)
        if isinstance(leaf, jax.Array)
    }
    restored_equal = largest_relative(restored, ulysses)  # before the epoch donates it
    want = jax.device_get(want)  # kept: the second epoch donates the state it starts from
    second_start = fg.shard_parameters(want, one, "replicated")
    want_second, want_second_metrics = epoch(second_start, None, "ulysses", 2)
    resumed, resumed_metrics = epoch(restored, by_four, "ring", 2)

    def policy(state):
        return state.variables.policy

    sharded_base = [
        leaf
        for leaf in jax.tree.leaves(eqx.filter(policy(ulysses).base, eqx.is_inexact_array))
        if leaf.size >= 256
    ]
    return {
        "moved": relative(
            jax.tree.leaves(policy(want).adapters)[0],
            jax.tree.leaves(parts["ulysses"][2].variables.policy.adapters)[0],
        ),
        "ulysses_fsdp_2x2": largest_relative(policy(ulysses), policy(want)),
        "ring_1x4": largest_relative(policy(ring), policy(want)),
        "losses": [want_metrics["loss"], ulysses_metrics["loss"], ring_metrics["loss"]],
        "rewards": [
            want_metrics["reward_mean"],
            ulysses_metrics["reward_mean"],
            ring_metrics["reward_mean"],
        ],
        "base_split_over_4": all(
            leaf.addressable_shards[0].data.size * 4 == leaf.size for leaf in sharded_base
        )
        and bool(sharded_base),
        "restored_meshes": [dict(mesh) for mesh in restored_meshes],
        "restored_equal": restored_equal,
        "resumed_second_epoch": largest_relative(policy(resumed), policy(want_second)),
        "second_losses": [want_second_metrics["loss"], resumed_metrics["loss"]],
    }


def streams_report() -> dict:
    """`join_streams` over 4 devices: the documented order (each device's own text tokens,
    then its own image tokens), split over the axis, and `part_streams` undoing it."""
    text_tokens = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    image_tokens = -jnp.arange(1, 16 * 3 + 1, dtype=jnp.float32).reshape(16, 3)
    with jax.set_mesh(fg.data_mesh(4, sequence=4)):
        joined = jax.jit(join_streams)(text_tokens, image_tokens)
        parted = jax.jit(part_streams, static_argnums=1)(joined, 8)
    want = np.concatenate(
        [np.concatenate([text_tokens[2 * d : 2 * d + 2], image_tokens[4 * d : 4 * d + 4]])
         for d in range(4)]
    )  # fmt: skip
    return {
        "order": bool(np.array_equal(np.asarray(joined), want)),
        "split": [s.data.shape[0] for s in joined.addressable_shards],
        "parted": [bool(np.array_equal(np.asarray(a), np.asarray(b)))
                   for a, b in zip(parted, (text_tokens, image_tokens), strict=True)],
    }  # fmt: skip


def main() -> None:
    assert jax.device_count() == 4, jax.device_count()
    section = sys.argv[1]
    parts = {
        "models": [
            ("attention", attention_report),
            ("streams", streams_report),
            ("models", models_report),
        ],
        "training": [("epoch", lambda: epoch_report(pathlib.Path(sys.argv[2])))],
    }[section]
    report = {}
    for name, part in parts:
        started = time.perf_counter()
        report[name] = part()
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
