"""What the tests against diffusers' fixtures share: the batched call, the relative error,
leafwise closeness of two gradients, the parameter count, and a LoRA policy whose adapters
all do something."""

import json
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from flowgrpo_eqx import lora


@eqx.filter_jit
def vcall(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    """The model's velocity on a batch: one compiled program per model structure."""
    out: jax.Array = jax.vmap(model)(x, t, cond)
    return out


@eqx.filter_jit
def velocity_and_sin_gradient(model: Any, x: Any, t: Any, cond: Any) -> tuple[jax.Array, Any]:
    """The velocities and the gradient of `sum(sin(v))` over the model's float parameters,
    in one program."""

    def value(params: Any) -> tuple[jax.Array, jax.Array]:
        v = jax.vmap(eqx.combine(params, static))(x, t, cond)
        return jnp.sum(jnp.sin(v)), v

    params, static = eqx.partition(model, eqx.is_inexact_array)
    (_, velocity), gradient = jax.value_and_grad(value, has_aux=True)(params)
    return velocity, gradient


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest absolute error over the largest `|want|`."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def assert_leaves_close(got: Any, want: Any, tolerance: float) -> None:
    """Each leaf of the tree `got` within `tolerance` times the largest `|entry|` of the same
    leaf of `want` (a gradient's leaves differ in scale by orders of magnitude)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(np.max(np.abs(np.asarray(b)))) + 1e-30
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tolerance * scale)


def count(model: Any) -> int:
    """The number of parameters (array elements) of a model, abstract or not; every one a
    float."""
    leaves = jax.tree.leaves(model)
    assert all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves)
    return sum(int(np.prod(leaf.shape)) for leaf in leaves)


def random_lora(model: Any) -> Any:
    """Rank-2 adapters (alpha 3) on every layer `lora.add` adapts, each `b` drawn at random
    (a fresh `b` is zero, which would hide a wrong layout)."""
    policy = lora.add(model, 2, key=jax.random.key(1), alpha=3.0)
    rng = np.random.default_rng(1)
    return eqx.tree_at(
        lambda p: [a.b for a in p.adapters],
        policy,
        [jnp.asarray(rng.standard_normal(a.b.shape), jnp.float32) for a in policy.adapters],
    )


def assert_layout_is(model: Any, keys: dict[str, list[int]]) -> None:
    """Every key of a published checkpoint layout (`{key: shape}`) maps to a leaf of `model` of
    that shape (through the key's conversion), and every leaf has exactly one key."""
    from flowgrpo_eqx.models._diffusers import _layout

    layout = {entry.key: entry for entry in _layout(model)}
    assert set(layout) == set(keys)
    for key, shape in keys.items():
        entry = layout[key]
        assert entry.shape == tuple(shape), key
        assert entry.to_ours(np.empty(shape, np.float32)).shape == entry.where(model).shape, key
    reached = {id(entry.where(model)) for entry in layout.values()}
    assert reached == {id(leaf) for leaf in jax.tree.leaves(model)}


WEIGHTS = "diffusion_pytorch_model.safetensors"


def assert_saved_folder_matches(
    original: pathlib.Path,
    saved: pathlib.Path,
    *,
    same_fields: bool = False,
    unsaved: tuple[str, ...] = (),
) -> None:
    """`save_diffusers`'s folder `saved` holds `original`'s weights, key for key and bit for
    bit, and every config field it writes (but `_diffusers_version` and `unsaved`) has the
    original's value; with `same_fields`, it writes exactly the original's fields."""
    weights, saved_weights = load_file(original / WEIGHTS), load_file(saved / WEIGHTS)
    assert set(saved_weights) == set(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(saved_weights[key], value, err_msg=key)
    config = json.loads((original / "config.json").read_text())
    written = json.loads((saved / "config.json").read_text())
    if same_fields:
        assert set(written) == set(config)
    for key, value in written.items():
        if key not in ("_diffusers_version", *unsaved):
            assert config[key] == value, key


def assert_exported_lora_merges(
    policy: Any, weights: pathlib.Path, folder: pathlib.Path
) -> set[str]:
    """Write `policy`'s adapters (`save_diffusers_lora`) and its merged model
    (`save_diffusers` of `lora.merge`) under `folder`, and check that every exported module's
    weight in `weights` (its base's diffusers file) plus `lora_B @ lora_A` is the merged
    weight: the adapters' scale `alpha / rank` is folded into `lora_B`, and a convolution's
    `lora_B` is `[out, rank, 1, ...]` over `lora_A`'s `[rank, in, *kernel]`.

    **Returns:**

    The diffusers names of the exported modules (without the `transformer.` prefix).
    """
    from flowgrpo_eqx.models import save_diffusers, save_diffusers_lora

    save_diffusers_lora(folder / "lora", policy)
    save_diffusers(folder / "merged", lora.merge(policy))
    return assert_merged_is_base_plus_adapters(
        folder / "lora", weights, folder / "merged" / WEIGHTS
    )


def assert_merged_is_base_plus_adapters(
    lora_folder: pathlib.Path, weights: pathlib.Path, merged_weights: pathlib.Path
) -> set[str]:
    """Check that every module of the exported adapters in `lora_folder` has, in
    `merged_weights`, its weight in `weights` (the base's diffusers file) plus `lora_B @
    lora_A` (see `assert_exported_lora_merges`).

    **Returns:**

    The diffusers names of the exported modules (without the `transformer.` prefix).
    """
    adapters = load_file(lora_folder / "pytorch_lora_weights.safetensors")
    base, merged = load_file(weights), load_file(merged_weights)
    modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in adapters}
    assert len(adapters) == 2 * len(modules)
    for module in modules:
        a = adapters[f"transformer.{module}.lora_A.weight"]
        b = adapters[f"transformer.{module}.lora_B.weight"]
        update = np.tensordot(b.reshape(b.shape[:2]), a, axes=1)
        np.testing.assert_allclose(
            base[f"{module}.weight"] + update, merged[f"{module}.weight"], atol=1e-5, err_msg=module
        )
    return modules
