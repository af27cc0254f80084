"""`tools.tpu.joint_layout`: the joint attention with the streams joined, padded and
transposed once computes the library's velocity and gradient (splash attention, in
Pallas's interpreter on the CPU), for SD3's order of the streams and FLUX's, and is put
back after."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from flowgrpo_eqx.models import Flux, MMDiT, _flux, _mmdit, _sequence
from tests.diffusers_helpers import assert_leaves_close
from tests.tiny_models import SD35_SHAPED, batch_of_two, perturbed
from tools.tpu.joint_layout import joined_padded_attend_joint, joint_attention


def _value_and_grad(model: Any, *inputs: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """The velocities of the batch and the gradient of `sum(sin(v))` in the parameters,
    traced afresh (so that the attention in scope is the one traced)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def value(params: Any) -> tuple[jax.Array, jax.Array]:
        v = jax.vmap(eqx.combine(params, static))(*inputs)
        return jnp.sum(jnp.sin(v)), v

    (_, v), grads = jax.jit(jax.value_and_grad(value, has_aux=True))(params)
    return np.asarray(v), [np.asarray(g) for g in jax.tree.leaves(grads)]


def _assert_same(model: Any, *inputs: Any) -> None:
    library_v, library_g = _value_and_grad(model, *inputs)
    assert np.abs(library_v).max() > 1e-2
    with joint_attention(joined_padded_attend_joint):
        assert _mmdit.attend_joint is _flux.attend_joint is joined_padded_attend_joint
        variant_v, variant_g = _value_and_grad(model, *inputs)
    assert _mmdit.attend_joint is _flux.attend_joint is _sequence.attend_joint
    np.testing.assert_allclose(variant_v, library_v, rtol=1e-5, atol=1e-5)
    assert_leaves_close(variant_g, library_g, 1e-5)


def test_sd3s_order_of_the_streams_computes_the_same() -> None:
    model = MMDiT(**SD35_SHAPED, attention="splash", attention_chunk=128, key=jax.random.key(0))
    _assert_same(perturbed(model), *batch_of_two(3))


def test_fluxs_order_of_the_streams_computes_the_same() -> None:
    model = Flux(
        image_size=(4, 6),
        channels=2,
        guidance_embeds=True,
        attention="splash",
        attention_chunk=128,
        key=jax.random.key(0),
    )
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 6, 2)).astype(np.float32)
    t = np.asarray([0.3, 0.8], np.float32)
    cond = {
        "context": rng.standard_normal((2, model.context_length, model.context_dim)),
        "pooled": rng.standard_normal((2, model.pooled_dim)),
        "guidance": np.asarray([3.5, 4.0]),
    }
    cond = {name: value.astype(np.float32) for name, value in cond.items()}
    _assert_same(perturbed(model), x, t, cond)
