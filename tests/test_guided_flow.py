"""GuidedFlow: the decoder's clip, the model call's casts and checks, the ODE sampler's
dtypes, the null condition's shapes, and the constructor's messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from tests.errors import NAMED_ARGUMENT_ERRORS, exact_message, raises_named


# --------------------------------------------------------------------------------------
# GuidedFlow: the decoder's clip to [-1, 1], the bfloat16 cast of what the model sees, and
# the time the ODE sampler passes in the state's dtype.


def _times_model(x, t, cond):
    return x * t


class _Doubling(fg.AbstractAutoEncoder):
    """A decoder whose samples leave [-1, 1] (the identity one clips on its own)."""

    def encode(self, sample):
        return sample / 2

    def decode(self, latent):
        return latent * 2


def test_decode_clips_to_minus_one_and_one():
    flow = fg.GuidedFlow(
        _times_model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None, autoencoder=_Doubling()
    )
    latents = jnp.asarray([[-3.0, -0.5, -0.125], [0.375, 0.5, 2.0]], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(flow.decode(latents)), [[-1.0, -1.0, -0.25], [0.75, 1.0, 1.0]]
    )


def test_embedded_guidance_gives_the_model_the_scale_in_one_call():
    calls = []

    def model(x, t, cond):
        calls.append(sorted(cond))
        return x * cond["guidance"] + cond["label"]

    # No null condition: a guidance-distilled model has no unconditional branch.
    flow = fg.GuidedFlow(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(select=("label",)),
        guidance=fg.EmbeddedGuidance(2.5),
    )
    x = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], jnp.float32)
    rows = {"label": jnp.asarray([0.5, 1.0, 2.0], jnp.float32), "id": jnp.arange(3)}
    v = flow.velocity(model, x, jnp.full((3,), 0.5, jnp.float32), rows)
    np.testing.assert_allclose(np.asarray(v), 2.5 * np.asarray(x) + [[0.5], [1.0], [2.0]])
    assert calls == [["guidance", "label"]]  # one traced call over the three rows
    both = fg.InputSpec(select=("label", "guidance"))
    clash = fg.GuidedFlow(model, fg.RectifiedFlow(), both, fg.EmbeddedGuidance())
    with pytest.raises(ValueError, match="EmbeddedGuidance adds 'guidance'"):
        clash.velocity(
            model, x, jnp.ones((3,)), {"label": rows["label"], "guidance": rows["label"]}
        )
    unselected = fg.GuidedFlow(model, fg.RectifiedFlow(), fg.InputSpec(), fg.EmbeddedGuidance())
    with pytest.raises(ValueError, match="InputSpec"):
        unselected.velocity(model, x, jnp.ones((3,)), rows["label"])
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`?scale`?"):
        fg.EmbeddedGuidance(-1.0)


def test_bfloat16_precision_casts_only_wide_floats_for_the_model():
    seen = {}

    def model(x, t, cond):
        seen.update(x=x.dtype, t=t.dtype, scale=cond["scale"].dtype, label=cond["label"].dtype)
        seen["half"] = cond["half"].dtype
        return x * t * cond["scale"] * cond["half"].astype(x.dtype)

    flow = fg.GuidedFlow(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(),
        guidance=None,
        precision="bfloat16",
    )
    cond = {
        "scale": jnp.full((2,), 2.0, jnp.float32),
        "label": jnp.asarray([3, 4], jnp.int32),
        "half": jnp.ones((2,), jnp.float16),
    }
    x = jnp.asarray([[1.0, -0.5], [0.25, 4.0]], jnp.float32)
    got = flow.call_model(model, x, jnp.asarray([0.5, 0.5], jnp.float32), cond)
    assert seen == dict(
        x=jnp.bfloat16, t=jnp.bfloat16, scale=jnp.bfloat16, label=jnp.int32, half=jnp.float16
    )
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), [[1.0, -0.5], [0.25, 4.0]])


def test_the_sampler_gets_times_in_the_state_dtype():
    seen = []

    def model(x, t, cond):
        seen.append(t.dtype)
        return x * t

    flow = fg.GuidedFlow(model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    # The solvers' float32 time steps meet a float64 state only under standard promotion.
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        noise = jnp.ones((2, 3), jnp.float64)
        got = flow.sample_latents(model, jnp.zeros((2, 1)), noise, fg.Euler(), 3)
        assert got.dtype == jnp.float64 and set(seen) == {jnp.dtype(jnp.float64)}
        low = flow.sample_latents(
            model, jnp.zeros((2, 1)), noise.astype(jnp.bfloat16), fg.Euler(), 3
        )
        assert low.dtype == jnp.float32
    # Two Euler steps of v = x t from t = 1: x (1 - 1/2) (1 - 1/4).
    np.testing.assert_allclose(np.asarray(got), np.full((2, 3), 0.375), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------
# The null condition's per-example shapes are checked against the rows'.


def test_a_null_condition_of_another_shape_is_named():
    flow = fg.GuidedFlow(
        _times_model, fg.RectifiedFlow(), fg.InputSpec(null=jnp.zeros(3)), guidance=fg.CFG(2.0)
    )
    message = (
        "The rows' conditioning does not match the null condition: per example the rows give "
        "shapes (2,), the null condition (InputSpec.null) (3,)."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        flow.null_like(jnp.zeros((4, 2)))
    with pytest.raises(
        ValueError, match=r"rows give shapes \(2, 3\), the null condition .* \(2, 4\)"
    ):
        fg.GuidedFlow(
            _times_model, fg.RectifiedFlow(), fg.InputSpec(null=jnp.zeros((2, 4))),
        ).null_like(jnp.zeros((1, 2, 3)))  # fmt: skip
    assert flow.null_like(jnp.ones((4, 3))).shape == (4, 3)


def test_guided_flow_messages_are_exact():
    def flow(**settings):
        arguments = dict(
            model=_times_model, process=fg.RectifiedFlow(), inputs=fg.InputSpec(), guidance=None
        )
        return fg.GuidedFlow(**(arguments | settings))

    with raises_named("`model` must be callable as model(x, t, cond), got 3."):
        flow(model=3)
    with raises_named("`process` must be an AbstractProcess, got 'rectified'."):
        flow(process="rectified")
    with raises_named("`inputs` must be an InputSpec, got None."):
        flow(inputs=None)
    with raises_named(
        "`guidance` must be an AbstractGuidance (a CFG, an EmbeddedGuidance) or None, got 3.0."
    ):
        flow(guidance=3.0)
    with raises_named("`autoencoder` must be an AbstractAutoEncoder, got 'vae'."):
        flow(autoencoder="vae")
    precisions = "('float32', 'bfloat16')"
    with raises_named(f"`precision` must be one of {precisions}, got 'float16'."):
        flow(precision="float16")
    needs_null = (
        "`guidance` needs a null condition, but `inputs` has none: pass InputSpec(null=...) or "
        "guidance=None."
    )
    with pytest.raises(ValueError, match=exact_message(needs_null)):
        flow(guidance=fg.CFG(2.0))


def test_a_velocity_of_the_wrong_shape_is_named_with_both_shapes():
    flow = fg.GuidedFlow(_times_model, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    message = (
        "The model returned a velocity of shape (2, 4) for a latent of shape (3, 4); "
        "model(x, t, cond) must return one velocity shaped like its x."
    )
    with pytest.raises(ValueError, match=exact_message(message)):
        flow.call_model(lambda x, t, cond: x[:-1], jnp.ones((2, 3, 4)), jnp.ones(2), None)
