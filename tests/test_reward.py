import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.rewards._reward import score
from tests.cli_rewards import brightness


def smooth_and_noisy(n=4, size=16, seed=0):
    rng = np.random.default_rng(seed)
    smooth = np.zeros((n, size, size, 3)) + np.linspace(-1, 1, size)[None, None, :, None]
    noisy = rng.uniform(-1, 1, size=(n, size, size, 3))
    return np.concatenate([smooth, noisy])


def test_jpeg_rewards_rank_noise_as_incompressible():
    samples = smooth_and_noisy()
    rows = {"id": np.arange(8)}
    compress = fg.JpegCompressibility()(samples, rows)
    incompress = fg.JpegIncompressibility()(samples, rows)
    assert compress.dtype == np.float64 and compress.shape == (8,)
    np.testing.assert_array_equal(compress, -incompress)
    assert incompress[4:].min() > incompress[:4].max()
    assert np.all(incompress > 0)


def test_jpeg_quality_checked():
    with pytest.raises(ValueError, match="quality"):
        fg.JpegCompressibility(quality=0)


def test_weighted_reward_sums_checked_float64_scores():
    samples = smooth_and_noisy()

    def tiny(s, rows):
        return np.full(s.shape[0], 1e-12)

    weighted = fg.WeightedReward(
        [(fg.JpegIncompressibility(), 0.5), (brightness, 2.0), (tiny, 3.0)]
    )
    got = weighted(samples, None)
    want = 0.5 * fg.JpegIncompressibility()(samples, None) + 2.0 * brightness(samples, None) + 3e-12
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)
    assert set(weighted.components(samples, None)) == {
        "jpeg_incompressibility",
        "brightness",
        "tiny",
    }
    assert "0.5*jpeg_incompressibility" in weighted.name


def test_weighted_reward_propagates_named_errors():
    def broken(s, rows):
        return np.full(s.shape[0], np.nan)

    weighted = fg.WeightedReward([(broken, 1.0)])
    with pytest.raises(fg.RewardError, match="broken"):
        score(weighted, smooth_and_noisy(), None)


def test_weighted_reward_rejects_bad_terms():
    with pytest.raises(ValueError, match="terms"):
        fg.WeightedReward([])
    with pytest.raises(ValueError, match="terms"):
        fg.WeightedReward([(fg.JpegCompressibility(), float("nan"))])


def test_score_rejects_non_numbers_and_names_reward():
    def words(s, rows):
        return ["a"] * s.shape[0]

    with pytest.raises(fg.RewardError, match="words"):
        score(words, np.zeros((2, 4, 4, 3)), None)


def test_any_callable_is_a_flow_reward():
    assert isinstance(fg.JpegCompressibility(), fg.FlowReward)
    assert isinstance(lambda s, r: s, fg.FlowReward)


def _with_non_finite(samples):
    samples = np.array(samples, dtype=np.float32)
    samples[1, 0, 0, 0] = np.nan
    samples[3, 2, 1, 0] = np.inf
    return samples


SHIPPED_REWARDS = pytest.mark.parametrize(
    "reward",
    [
        fg.JpegCompressibility(),
        fg.JpegIncompressibility(),
        fg.WeightedReward([(lambda s, r: np.zeros(len(s)), 1.0)]),
        fg.HttpReward("http://127.0.0.1:9", retries=0),  # refused before any request
    ],
    ids=["jpeg_compressibility", "jpeg_incompressibility", "weighted", "http"],
)
"""Every shipped reward, each of which checks its samples before any work."""


@SHIPPED_REWARDS
def test_shipped_rewards_refuse_non_finite_samples_naming_the_rows(reward):
    samples = _with_non_finite(smooth_and_noisy())
    with pytest.raises(fg.RewardError, match=r"non-finite `samples` .* at rows \[1, 3\]"):
        reward(samples, {"id": np.arange(8)})
    with pytest.raises(fg.RewardError, match=r"rows \[1, 3\]"):
        score(reward, samples, {"id": np.arange(8)})
    if isinstance(reward, fg.JpegIncompressibility):
        finite = smooth_and_noisy()
        assert np.all(np.isfinite(reward(finite, None)))


@SHIPPED_REWARDS
def test_shipped_rewards_refuse_an_empty_batch_by_name(reward):
    """An empty batch reached `reshape(0, -1)` and raised a raw numpy error."""
    empty = np.zeros((0, 16, 16, 3), np.float32)
    with pytest.raises(fg.RewardError, match=r"empty batch \(`samples` of shape \(0, 16, 16, 3\)"):
        reward(empty, {"id": np.arange(0)})


def test_the_shapes_reward_refuses_an_empty_batch_by_name():
    from flowgrpo_eqx.shapes_demo.job import BUILTIN_REWARDS

    for name in ("partial", "strict"):
        with pytest.raises(fg.RewardError, match="shapes_.*empty batch"):
            BUILTIN_REWARDS[name]()(np.zeros((0, 16, 16, 3)), {"tokens": np.zeros((0, 4), int)})
