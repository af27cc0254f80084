"""Flow-DPPO against UniRL's own code run on the CPU (`tests/data/released/flowdppo.npz`, made
by `tools/make_released_fixtures.py`) and against the float64 statements of that code
(`numpy_reference`): the steps a rollout samples with noise, the KL's std as released and as
its open fix computes it, the KL, mask and loss, and the advantages over the batch."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from tests import numpy_reference as ref


FIXTURE = np.load(pathlib.Path(__file__).parent / "data" / "released" / "flowdppo.npz")


def test_the_rollouts_steps_are_the_schedulers():
    schedule = fg.RandomSteps(3, fraction=(0.0, 0.5))
    for rollout, released in enumerate(FIXTURE["sde_indices"]):
        assert list(schedule.steps(rollout + 1, 10)) == released.tolist()
        assert released.tolist() == ref.unirl_sde_indices(10, (0.0, 0.5), 3, rollout)


def _kl_stds(kind):
    sigmas = jnp.asarray(FIXTURE["sigmas"])
    sde = fg.FlowSDE(0.7)
    _, transition = jax.vmap(lambda a, b: sde.transition(jnp.zeros(2), jnp.zeros(2), a, b))(
        sigmas[:-1], sigmas[1:]
    )
    return np.asarray(
        jax.vmap(lambda a, b, s: kind(sde, a, b, s))(sigmas[:-1], sigmas[1:], transition)
    )


def test_the_kl_std_is_the_releases_and_the_fix_is_the_pull_requests():
    # float32 on both sides: the same formula, rounded in a different order.
    np.testing.assert_allclose(_kl_stds(fg.ReleasedKLStd()), FIXTURE["sigma_t"], rtol=1e-6)
    np.testing.assert_allclose(_kl_stds(fg.TransitionKLStd()), FIXTURE["sigma_t_pr38"], rtol=1e-6)
    released64 = ref.unirl_kl_sigma(FIXTURE["sigmas"].astype(np.float64), range(10), 0.7)
    np.testing.assert_allclose(FIXTURE["sigma_t"], released64, rtol=1e-6)
    assert FIXTURE["sigma_t_pr38"][0] == np.float32(0.7)


def test_the_kl_mask_and_loss_are_the_releases():
    objective = fg.FlowDPPOObjective(
        fg.GuidedFlow(lambda x, t, c: x, fg.RectifiedFlow(), fg.InputSpec(), guidance=None)
    )
    per_row = jax.vmap(objective.divergence, in_axes=(0, 0, None))
    sigma = FIXTURE["kl_sigma"]
    kl = np.stack(
        [
            np.asarray(
                per_row(
                    jnp.asarray(FIXTURE["new_means"][:, j]),
                    jnp.asarray(FIXTURE["old_means"][:, j]),
                    sigma[j],
                )
            )
            for j in range(sigma.size)
        ],
        axis=1,
    )
    released_kl = np.asarray(
        [
            [
                ref.dppo_kl(FIXTURE["new_means"][i, j], FIXTURE["old_means"][i, j], sigma[j])
                for j in range(sigma.size)
            ]
            for i in range(kl.shape[0])
        ]
    )
    np.testing.assert_allclose(kl, released_kl, rtol=1e-5)
    np.testing.assert_allclose(kl.mean(), FIXTURE["metric_kl_new_old_mean"], rtol=1e-5)
    log_ratio = FIXTURE["new_logp"].astype(np.float64) - FIXTURE["old_logp"]
    ratio = np.exp(log_ratio)
    advantages = FIXTURE["dppo_advantages"]
    dropped = np.asarray(fg.divergence_mask(kl, ratio, advantages, 1e-5))
    assert 0 < dropped.sum() < dropped.size
    np.testing.assert_allclose(dropped.mean(), FIXTURE["metric_masked_fraction"], rtol=1e-6)
    np.testing.assert_allclose(
        (dropped & (advantages > 0)).mean(), FIXTURE["metric_pos_rm_fraction"], rtol=1e-6
    )
    np.testing.assert_allclose((kl >= 1e-5).mean(), FIXTURE["metric_kl_mask_fraction"], rtol=1e-6)
    kept = np.ones(kl.shape, bool)
    total, count, ref_dropped = ref.dppo_loss(log_ratio, kl, advantages, kept, 1e-5)
    np.testing.assert_array_equal(ref_dropped, dropped)
    np.testing.assert_allclose(
        np.where(dropped, 0.0, -advantages * ratio), FIXTURE["loss_per_elem"], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(total / count, FIXTURE["loss_per_elem"].mean(), rtol=1e-5)


def test_the_advantages_are_the_releases_global_std():
    got = fg.group_advantages(FIXTURE["rewards"], 4, std="global_unbiased")
    np.testing.assert_allclose(got, FIXTURE["global_std_advantages"], rtol=2e-6, atol=1e-7)
    want = ref.unirl_global_std_advantages(FIXTURE["rewards"], 4)
    np.testing.assert_allclose(FIXTURE["global_std_advantages"], want, rtol=2e-6, atol=1e-7)
    assert np.all(got[4:8] == 0.0)
