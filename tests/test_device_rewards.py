"""Rewards on the device: PickScore from decoded images, end to end against flow_grpo's
scorer run by transformers (`tools/make_clip_fixtures.py`), and `DeviceReward`."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import CLIPModel, load_clip
from flowgrpo_eqx.rewards import CLIPScore, DeviceReward, PickScore
from tests.tolerances import reference_model_rtol


CLIP = pathlib.Path(__file__).resolve().parent / "data" / "clip"


@pytest.fixture(scope="module")
def pickscore() -> PickScore:
    model = load_clip(CLIP / "model")
    assert isinstance(model, CLIPModel)
    return PickScore(model)


def test_pickscore_of_decoded_images_is_flow_grpos(pickscore: PickScore) -> None:
    io = dict(np.load(CLIP / "processor.npz"))
    prompts = jax.vmap(pickscore.prompt_embedding)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"]))
    images = jnp.asarray(io["square"] * 2.0 - 1.0)  # decoded images are in [-1, 1]
    scores = np.asarray(jax.vmap(pickscore)(images, prompts))
    np.testing.assert_allclose(scores, io["square_pickscore"], rtol=reference_model_rtol())
    # Resized by JAX rather than PIL: close, not equal (tests/test_clip.py).
    wide = np.asarray(jax.vmap(pickscore)(jnp.asarray(io["wide"] * 2.0 - 1.0), prompts))
    np.testing.assert_allclose(wide, io["wide_pickscore"], rtol=0.05)


def test_a_device_reward_scores_a_batch_in_float64(pickscore: PickScore) -> None:
    io = dict(np.load(CLIP / "processor.npz"))
    prompts = np.asarray(
        jax.vmap(pickscore.prompt_embedding)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"]))
    )
    reward = DeviceReward(pickscore, key="prompt", name="pickscore")
    samples = (io["square"] * 2.0 - 1.0).astype(np.float32)
    scores = reward(samples, {"prompt": prompts})
    assert scores.dtype == np.float64 and scores.shape == (2,)
    np.testing.assert_allclose(scores, io["square_pickscore"], rtol=reference_model_rtol())
    with pytest.raises(ValueError, match="'prompt'"):
        reward(samples, {"other": prompts})


def test_clip_score_is_the_cosine_transformers_features_give(pickscore: PickScore) -> None:
    io = dict(np.load(CLIP / "processor.npz"))
    score = CLIPScore(pickscore.model)
    prompts = jax.vmap(score.prompt_embedding)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"]))
    got = np.asarray(jax.vmap(score)(jnp.asarray(io["square"] * 2.0 - 1.0), prompts))
    # The cosine of transformers' features, from flow_grpo's PickScore of the same images.
    cosine = io["square_pickscore"].astype(np.float64) * 26 / np.exp(float(score.model.logit_scale))
    np.testing.assert_allclose(
        got, 100 * np.maximum(cosine, 0), rtol=reference_model_rtol(), atol=1e-4
    )
