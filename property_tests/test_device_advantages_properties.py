"""`device_group_advantages` (float32, on the device) against the float64 statement of
docs/mathematics/index.md §7 (`tests/numpy_reference.group_advantages`), within the tolerance its
docstring promises."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import flowgrpo_eqx as fg
import flowgrpo_eqx.testing as T
from tests import numpy_reference as ref


EPS = 1e-4


@st.composite
def _scores(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    groups = draw(st.integers(2, 6))
    prompts = draw(st.integers(1, 5))
    elements = st.floats(-100.0, 100.0, width=32, allow_nan=False, allow_infinity=False)
    values = draw(hnp.arrays(np.float32, (prompts * groups,), elements=elements))
    if draw(st.booleans()):  # some groups constant, some nearly so
        values = np.round(values, draw(st.integers(0, 2))).astype(np.float32)
    return values, groups


@T.property_settings(200)
@given(batch=_scores(), std=st.sampled_from(("group", "global")))
def test_device_advantages_are_the_float64_statement_within_the_promise(batch, std):
    scores, groups = batch
    got = np.asarray(fg.device_group_advantages(jnp.asarray(scores), groups, EPS, std))
    want = ref.group_advantages(scores.astype(np.float64), groups, EPS, std)
    grouped = scores.astype(np.float64).reshape(-1, groups)
    if std == "group":
        spread = np.repeat(grouped.std(axis=1), groups)
    else:
        spread = np.full(scores.shape, scores.astype(np.float64).std())
    bound = 1e-5 * (1.0 + np.abs(scores) / (spread + EPS))
    assert got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound)
    constant = np.repeat(np.all(grouped == grouped[:, :1], axis=1), groups)
    assert np.all(got[constant] == 0.0)
