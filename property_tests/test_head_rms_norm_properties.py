"""Properties of `head_rms_norm`, the query-key norm of SD3's and FLUX's attention: heads
are normalised apart (scaling one head's input leaves every output as it was), and each
head's output has unit root mean square times the weight."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx.testing as T
from flowgrpo_eqx.models._layers import head_rms_norm


@st.composite
def _heads(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heads `[S, heads, head_dim]`, a weight `[head_dim]`, and a positive factor per head,
    from 1e-2 to 1e2."""
    heads = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([8, 64, 128]))
    seq = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(T.seeds()))
    h = rng.standard_normal((seq, heads, dim)).astype(np.float32)
    weight = (1.0 + 0.5 * rng.standard_normal(dim)).astype(np.float32)
    factors = (10.0 ** rng.uniform(-2, 2, size=(1, heads, 1))).astype(np.float32)
    return h, weight, factors


@T.property_settings(40)
@given(_heads())
def test_scaling_one_heads_input_changes_no_output(drawn) -> None:
    h, weight, factors = drawn
    before = head_rms_norm(jnp.asarray(h), jnp.asarray(weight), eps=0.0)
    after = head_rms_norm(jnp.asarray(h * factors), jnp.asarray(weight), eps=0.0)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=2e-5, atol=2e-5)


@T.property_settings(40)
@given(_heads())
def test_each_heads_output_over_the_weight_has_unit_root_mean_square(drawn) -> None:
    h, weight, _ = drawn
    dim = weight.shape[0]
    out = np.asarray(head_rms_norm(jnp.asarray(h), jnp.ones(dim, jnp.float32), eps=0.0))
    np.testing.assert_allclose(np.mean(out.astype(np.float64) ** 2, axis=-1), 1.0, rtol=2e-5)
    weighted = np.asarray(head_rms_norm(jnp.asarray(h), jnp.asarray(weight), eps=0.0))
    np.testing.assert_allclose(weighted, out * weight, rtol=1e-6)
