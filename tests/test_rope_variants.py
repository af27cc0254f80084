"""`tools.tpu.rope_variants`: the rotary embedding's pairs turned in the heads' own lanes
compute the library's rotation, value and gradient, to the bit on the CPU, and swapped into
Wan 2.1 and FLUX.1 give diffusers' velocities (the library's own rotation against
diffusers: `tests/test_wan.py`, `tests/test_flux.py`)."""

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import _flux, _wan, load_diffusers
from flowgrpo_eqx.models._rope import apply_rope, rope_tables
from tests.diffusers_helpers import relative
from tests.tolerances import reference_model_rtol
from tools.tpu.rope_variants import VARIANTS, model_rope


DATA = pathlib.Path(__file__).resolve().parent / "data"
TURNED = [name for name, rope in VARIANTS.items() if rope is not None]


def _rotation_inputs(dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    draws = np.random.default_rng(3)
    qkv = jnp.asarray(draws.normal(size=(3, 7, 3, 8)) * 4.0, dtype)
    ids = np.stack([np.arange(7) // 3, np.arange(7) % 3, np.arange(7)], axis=1)
    cos, sin = rope_tables(ids.astype(np.float64), (2, 2, 4))
    return qkv, jnp.asarray(cos), jnp.asarray(sin)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", TURNED)
def test_the_turned_pairs_rotate_as_the_library_does_to_the_bit(name: str, dtype: Any) -> None:
    variant = VARIANTS[name]
    assert variant is not None
    qkv, cos, sin = _rotation_inputs(dtype)
    cotangent = jnp.asarray(np.random.default_rng(4).normal(size=qkv.shape), dtype)

    def value_and_pullback(rope: Any) -> tuple[np.ndarray, np.ndarray]:
        def traced() -> tuple[jax.Array, jax.Array]:
            out, pullback = jax.vjp(lambda x: rope(x, cos, sin), qkv)
            return out, pullback(cotangent)[0]

        out, grad = jax.jit(traced)()
        return np.asarray(out.astype(jnp.float32)), np.asarray(grad.astype(jnp.float32))

    want_value, want_grad = value_and_pullback(apply_rope)
    got_value, got_grad = value_and_pullback(variant)
    assert np.abs(want_value[:2] - np.asarray(qkv[:2].astype(jnp.float32))).max() > 0.1
    # The same float32 operations: equal bits on the CPU; elsewhere a compiler may fuse a
    # multiply and an add into one rounding, a unit in the last place of the result's dtype.
    ulp = 0.0 if jax.default_backend() == "cpu" else float(jnp.finfo(dtype).eps)
    for got, want in ((got_value, want_value), (got_grad, want_grad)):
        np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp * np.abs(want).max())


@pytest.mark.parametrize("name", TURNED)
@pytest.mark.parametrize(
    ("folder", "latent", "module"),
    [("wan_tiny", (3, 4, 6), _wan), ("flux_tiny", (8, 6), _flux)],
)
def test_swapped_into_a_model_it_gives_diffusers_velocity_and_is_put_back(
    name: str, folder: str, latent: tuple[int, ...], module: Any
) -> None:
    model = load_diffusers(DATA / folder, image_size=latent, context_length=5)
    io = dict(np.load(DATA / folder / "io.npz"))
    if folder == "wan_tiny":
        cond: Any = io["context"]
    else:
        cond = {"context": io["context"], "pooled": io["pooled"], "guidance": io["guidance"]}

    def velocity() -> np.ndarray:
        # A new function each time, so that each is traced with the rotation in place.
        return np.asarray(jax.jit(lambda: jax.vmap(model)(io["x"], io["t"], cond))())

    library = velocity()
    with model_rope(VARIANTS[name]):
        assert module.apply_rope is VARIANTS[name]
        swapped = velocity()
    assert module.apply_rope is apply_rope
    assert relative(swapped, io["v"]) < reference_model_rtol()
    np.testing.assert_allclose(swapped, library, rtol=1e-6, atol=1e-6 * np.abs(library).max())
