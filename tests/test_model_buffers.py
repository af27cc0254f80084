"""A model's `Buffer` arrays (the MMDiT's position table) stay out of training."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx._buffer import Buffer, freeze_buffers
from flowgrpo_eqx.models import MMDiT
from flowgrpo_eqx.train import FlowMatchingObjective, SupervisedBatch, Trainer, default_optimizer


SIZES = dict(
    image_size=6,
    channels=4,
    patch=2,
    depth=1,
    width=12,
    heads=2,
    context_length=2,
    context_dim=5,
    pooled_dim=5,
)
TABLE_SHAPE = (9, 12)  # (6 // 2) ** 2 patches by width 12: no other array has this shape


def _batch(rows: int) -> SupervisedBatch:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((rows, 6, 6, 4)).astype(np.float32)
    cond = {
        "context": rng.standard_normal((rows, 2, 5)).astype(np.float32),
        "pooled": rng.standard_normal((rows, 5)).astype(np.float32),
    }
    return SupervisedBatch(data=jnp.asarray(data), cond=jax.tree.map(jnp.asarray, cond))


def test_adamw_with_weight_decay_leaves_the_position_table_bit_identical() -> None:
    model = MMDiT(**SIZES, key=jax.random.key(0))
    assert isinstance(model.pos_embed, Buffer) and model.pos_embed.value.shape == TABLE_SHAPE
    table = np.asarray(model.pos_embed.value)
    assert np.abs(table).max() > 0.0
    inputs = fg.InputSpec(select=("context", "pooled"), latent_shape=(6, 6, 4))
    objective = FlowMatchingObjective(
        fg.GuidedFlow(model, fg.RectifiedFlow(), inputs, guidance=None),
        cond_dropout=0.0,
        time_sampling="uniform",
    )
    trainer = Trainer(objective, default_optimizer(1e-2, weight_decay=0.1))
    state = trainer.init(jax.random.key(1))

    trainable, frozen = trainer.split_policy(state.variables.policy)
    assert trainable.pos_embed.value is None
    assert isinstance(frozen.pos_embed.value, jax.Array)
    opt_shapes = [leaf.shape for leaf in jax.tree.leaves(state.opt_state) if eqx.is_array(leaf)]
    assert TABLE_SHAPE not in opt_shapes
    assert opt_shapes.count((12, 4 * 4)) == 2  # the patch embedding's Adam moments: trained

    batch = _batch(4)
    for _ in range(100):
        state, metrics = trainer.update(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    policy = state.variables.policy
    assert np.array_equal(np.asarray(policy.pos_embed.value), table)
    # The rest trained (and decayed): the patch embedding moved.
    assert not np.array_equal(np.asarray(policy.patch_embed.weight), model.patch_embed.weight)


def test_freeze_buffers_keeps_the_filter_elsewhere() -> None:
    tree = {"w": jnp.ones(2), "b": Buffer(jnp.ones(3)), "n": 1}

    def leaves(spec: object) -> dict[str, bool]:
        mask = freeze_buffers(spec, tree)
        assert jax.tree.structure(mask) == jax.tree.structure(tree)
        return dict(zip(["b", "n", "w"], jax.tree.leaves(mask), strict=True))

    assert leaves(eqx.is_inexact_array) == {"b": False, "n": False, "w": True}
    assert leaves(True) == {"b": False, "n": True, "w": True}
    assert leaves({"w": False, "b": True, "n": eqx.is_array}) == {
        "b": False,
        "n": False,
        "w": False,
    }
    with pytest.raises(ValueError, match="filter_spec"):
        freeze_buffers({"w": 1, "b": True, "n": True}, tree)
