"""Properties of `head_rms_norm`, the query-key norm of SD3's and FLUX's attention: heads
are normalised apart (scaling one head's input leaves every output as it was), and each
head's output has unit root mean square times the weight."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st

import flowgrpo_eqx.testing as T
from flowgrpo_eqx.models._layers import head_rms_norm


@st.composite
def _rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows `[S, heads x head_dim]`, a weight `[head_dim]`, and a positive factor per head,
    from 1e-2 to 1e2."""
    heads = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([8, 64, 128]))
    seq = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(T.seeds()))
    rows = rng.standard_normal((seq, heads * dim)).astype(np.float32)
    weight = (1.0 + 0.5 * rng.standard_normal(dim)).astype(np.float32)
    factors = (10.0 ** rng.uniform(-2, 2, size=heads)).astype(np.float32)
    return rows, weight, factors


@T.property_settings(40)
@given(_rows())
def test_scaling_one_heads_input_changes_no_output(drawn) -> None:
    rows, weight, factors = drawn
    dim = weight.shape[0]
    scaled = rows * np.repeat(factors, dim)[None, :]
    before = head_rms_norm(jnp.asarray(rows), jnp.asarray(weight), eps=0.0)
    after = head_rms_norm(jnp.asarray(scaled), jnp.asarray(weight), eps=0.0)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=2e-5, atol=2e-5)


@T.property_settings(40)
@given(_rows())
def test_each_heads_output_over_the_weight_has_unit_root_mean_square(drawn) -> None:
    rows, weight, _ = drawn
    seq, width = rows.shape
    dim = weight.shape[0]
    out = np.asarray(head_rms_norm(jnp.asarray(rows), jnp.ones(dim, jnp.float32), eps=0.0))
    per_head = out.astype(np.float64).reshape(seq, width // dim, dim)
    np.testing.assert_allclose(np.mean(per_head**2, axis=-1), 1.0, rtol=2e-5)
    weighted = np.asarray(head_rms_norm(jnp.asarray(rows), jnp.asarray(weight), eps=0.0))
    np.testing.assert_allclose(weighted, out * np.tile(weight, width // dim)[None, :], rtol=1e-6)
