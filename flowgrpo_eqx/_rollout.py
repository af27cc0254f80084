"""`FlowRollout`: sample complete prompt groups, score them, and make the training batch."""

import time
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ._advantages import (
    ADVANTAGE_STDS,
    AdvantageStd,
    RewardCombination,
    check_groups,
    group_advantages,
    per_reward_advantages,
    reward_advantages,
)
from ._custom_types import FinalSamples, Model, RolloutInfo, Transitions
from ._distributed import host_samples, place_rows, sequence_context
from ._guided_flow import GuidedFlow
from ._misc import check_bool, check_int, check_source_rows, leading_rows, repeat_rows
from ._sampling import AbstractSampler, Draw, Generated
from .objectives import AbstractRLObjective
from .rewards import FlowReward, WeightedReward, score_on_root


@final
class FlowRollout(eqx.Module):
    """Sample complete prompt groups with the objective's guided flow, score them, and make
    the batch it trains on.

    Each source row is repeated `groups` times and forms one group (equal conditioning in
    other rows never merges groups). One jit-compiled `lax.scan` integrates the objective's
    guided flow (its model inputs, process, guidance, autoencoder) from N(0, I) noise on the
    `steps`-point grid of the flow's process, with a sampler the objective accepts:

    - an `SDESampler` samples the SDE and records transitions and their log densities with
        the same code (`GuidedFlow.transition`) that `FlowGRPOObjective.log_probs` rescores
        with, and `collect` gives `Transitions`; a Flow-GRPO objective accepts only an
        `SDESampler` of its own `sde` (and uses `SDESampler(objective.sde)` by default);
    - an `ODESampler` records nothing but the final latents, and `collect` gives
        `FinalSamples` (what DiffusionNFT trains on).

    The final latents are decoded to samples in [-1, 1], the reward runs once on the host,
    and advantages use the population group std with epsilon 1e-4 in float64 (cast to
    float32 after normalisation), as Flow-GRPO's `PerPromptStatTracker` (`advantage_std` picks
    another release's statistic). Deterministic
    transitions and every transition of a zero-advantage row are masked (not dropped:
    shapes stay static).

    **Arguments:**

    - `objective`: the `AbstractRLObjective` the rollout collects for; its `flow` is sampled.
    - `reward`: a `FlowReward`.
    - `groups`: samples per source row, >= 2 (the group a sample's advantage is relative
        to; a group of one sample has advantage 0).
    - `steps`: time points of the rollout grid; `steps=11` draws ten transitions.
    - `sampler`: an `AbstractSampler` (`SDESampler`, `ODESampler`), or `None` (default) for
        the objective's own (`objective.rollout_sampler(None)`).
    - `advantage_std`: `"group"` (default), `"global"` (flow_grpo's `global_std`), or their
        unbiased forms with epsilon 1e-8: `"group_unbiased"` (DanceGRPO's) and
        `"global_unbiased"` (Flow-DPPO's, UniRL's `adv_use_global_std`); see
        `group_advantages`.
    - `reward_combination`: `"sum"` (default) normalises the reward's scores within each
        group; `"normalize_each"` needs a `WeightedReward` and normalises each of its terms
        within its group before the weighted sum (`per_reward_advantages`), so no term's
        scale drowns the others. `RolloutInfo.rewards` is the weighted sum either way.
    - `shared_noise`: if `True`, every sample of a group starts from the same N(0, I) draw
        (groups differ), so the group baseline compares sampler branches only (the
        release's `same_latent`); refused with an `ODESampler`, which would draw one sample
        per group. `False` (default) draws every sample's start independently.
    - `mesh`: a data mesh (`flowgrpo_eqx.data_mesh()`) to shard rows over, or `None` for the
        default device. With many processes, every process calls `collect` with the same
        global rows; generation is collective, the reward runs on process 0 only, and the
        returned batch holds global arrays of which each process owns its rows. On a mesh
        with a sequence axis (`data_mesh(sequence=n)`) the samples are generated under it
        (`jax.set_mesh`), so the models that support it split each sample's tokens.

    **Raises:**

    - `ValueError`: naming the argument, for an `objective` that is not an
        `AbstractRLObjective`, a `reward` that is not callable, a `sampler` that is not an
        `AbstractSampler`, one the objective refuses (for Flow-GRPO: anything that records no
        transitions of its `sde`) or that refuses the rollout's settings (see `SDESampler`,
        `ODESampler`), `groups < 2`, `steps < 2`, an unknown `advantage_std` or
        `reward_combination`, a `normalize_each` combination without a `WeightedReward`, or
        a `shared_noise` that is not a bool.
    """

    objective: AbstractRLObjective[Any, Any]
    reward: FlowReward
    groups: int = 4
    steps: int = 11
    sampler: AbstractSampler | None = None
    advantage_std: AdvantageStd = "group"
    reward_combination: RewardCombination = "sum"
    shared_noise: bool = eqx.field(default=False, static=True)
    mesh: Mesh | None = eqx.field(default=None, static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.objective, AbstractRLObjective):
            raise ValueError(
                "`objective` must be an AbstractRLObjective (FlowGRPOObjective, "
                f"DiffusionNFTObjective, ...), got {self.objective!r}."
            )
        if not callable(self.reward):
            raise ValueError(
                f"`reward` must be callable as reward(samples, rows), got {self.reward!r}."
            )
        check_groups(self.groups)
        check_int("steps", self.steps, 2)
        if self.reward_combination not in ("sum", "normalize_each"):
            raise ValueError(
                "`reward_combination` must be 'sum' or 'normalize_each', got "
                f"{self.reward_combination!r}."
            )
        if self.reward_combination == "normalize_each" and not isinstance(
            self.reward, WeightedReward
        ):
            raise ValueError(
                "`reward_combination='normalize_each'` needs a WeightedReward (its terms are "
                f"normalised one by one), got {self.reward!r}."
            )
        check_bool("shared_noise", self.shared_noise)
        if self.advantage_std not in ADVANTAGE_STDS:
            choices = ", ".join(repr(choice) for choice in ADVANTAGE_STDS)
            raise ValueError(
                f"`advantage_std` must be one of {choices}, got {self.advantage_std!r}."
            )
        if self.sampler is not None and not isinstance(self.sampler, AbstractSampler):
            raise ValueError(
                "`sampler` must be an AbstractSampler (SDESampler, ODESampler, MixSampler: "
                f"ODESampler(Heun()) for a solver), got {self.sampler!r}."
            )
        self.active_sampler.check_rollout(self.flow, self.steps, self.groups, self.shared_noise)

    @property
    def flow(self) -> GuidedFlow:
        """The guided flow the rollout samples: the objective's (`objective.flow`)."""
        return self.objective.flow

    @property
    def active_sampler(self) -> AbstractSampler:
        """The sampler the rollout uses: `sampler`, or the objective's own when it is `None`
        (`objective.rollout_sampler(sampler)`, which refuses a sampler the objective cannot
        train on)."""
        return self.objective.rollout_sampler(self.sampler)

    @property
    def recorded_transitions(self) -> int:
        """`K`, the number of recorded transitions per sample (0 with an `ODESampler`)."""
        return self.active_sampler.recorded_transitions(self.steps)

    def window_start(self, epoch: int, key: PRNGKeyArray) -> int:
        """The window's position in a `collect` in `epoch` with `key`: its first stochastic
        transition (the recorded ones start there, or where `count` still fit:
        `AbstractWindowSchedule.recorded_first`).

        **Arguments:**

        - `epoch`: the epoch, from 1.
        - `key`: the key passed to `collect`.

        **Returns:**

        The sampler's window position (`SDESampler(window_schedule=...)`), or 0.
        """
        return self.active_sampler.window_start(epoch, self.steps, key)

    def timesteps(self) -> Float[Array, " steps"]:
        """The rollout's time grid.

        **Returns:**

        `[steps]` times from 1 to 0, `flow.process.timesteps(steps)`.
        """
        return self.flow.process.timesteps(self.steps)

    def draw(self, policy: Model, rows: PyTree[Any], first: int | Int[Array, ""] = 0) -> Draw:
        """What `generate` samples: the flow, the policy, the rows and the recorded window.

        **Arguments:**

        - `policy`: the sampling model.
        - `rows`: `[N, ...]` conditioning rows on the device(s), already repeated per group
            (`N` a multiple of `groups` when `shared_noise`).
        - `first`: the window's position, `window_start(epoch, key)` (0 without a window
            schedule).

        **Returns:**

        The `Draw`.

        **Raises:**

        - `ValueError`: if the flow's `InputSpec` has no `latent_shape`, or if
            `shared_noise` and the rows are not whole groups.
        """
        if self.flow.inputs.latent_shape is None:
            raise ValueError(
                "FlowRollout needs the latent shape: pass InputSpec(latent_shape=...) to the "
                "objective (or the GuidedFlow)."
            )
        if self.shared_noise and leading_rows(rows) % self.groups:
            raise ValueError(
                f"`rows` must hold whole groups of {self.groups} with `shared_noise=True`, got "
                f"{leading_rows(rows)} rows."
            )
        return Draw(self.flow, policy, rows, jnp.asarray(first, jnp.int32), self.steps, self.mesh)

    def generate(
        self,
        policy: Model,
        rows: PyTree[Any],
        key: PRNGKeyArray,
        first: int | Int[Array, ""] = 0,
    ) -> Generated:
        """Sample rows already repeated into groups: what the sampler records, the final
        latents and the decoded samples.

        Jit-compiled, with static shapes.

        **Arguments:**

        - `policy`, `rows`, `first`: as for `draw`; `first` is traced, so any value reuses
            one compilation.
        - `key`: the PRNG key for the starting noise and the sampler's noise.

        **Returns:**

        The `Generated` trajectory record.

        **Raises:**

        - `ValueError`: as `draw`.
        """
        starts_per_group = self.groups if self.shared_noise else 1
        draw = self.draw(policy, rows, first)
        with sequence_context(self.mesh):
            return _generate(self.active_sampler, draw, starts_per_group, key)

    def collect(
        self, policy: Model, rows: PyTree[Any], key: PRNGKeyArray, epoch: int = 1
    ) -> tuple[Transitions | FinalSamples, RolloutInfo]:
        """Generate groups for the source `rows`, score them, and build the training batch.

        **Arguments:**

        - `policy`: the model that samples (for an RL objective,
            `objective.sampling_policy(variables)`). Never modified.
        - `rows`: the source rows, `[P, ...]` leaves (the structure `InputSpec` reads).
        - `key`: a PRNG key.
        - `epoch`: the epoch, from 1; places a window schedule's window (1 by default).

        **Returns:**

        `(batch, info)`: with an `SDESampler`, a `Transitions` batch of `N = P * groups` rows
        and `K` recorded transitions; with an `ODESampler`, the `FinalSamples` of those rows;
        and the host-side `RolloutInfo`.

        **Raises:**

        - `ValueError`: naming `rows` (and the leaf), before sampling anything, if it has no
            array leaves, its leaves differ in their leading size, or it holds no rows; or
            naming `InputSpec(latent_shape=...)` if the flow's inputs have no latent shape.
        - `RewardError`: naming the reward, if it raises or returns a wrong shape, NaN or inf.
        """
        check_source_rows("rows", rows)
        host_rows = repeat_rows(rows, self.groups)
        started = time.perf_counter()
        first = self.window_start(epoch, key)
        draw = self.draw(policy, place_rows(host_rows, self.mesh), first)
        starts_per_group = self.groups if self.shared_noise else 1
        with sequence_context(self.mesh):
            generated = _generate(self.active_sampler, draw, starts_per_group, key)
        jax.block_until_ready(generated)  # type: ignore[no-untyped-call]
        generated_at = time.perf_counter()
        samples = host_samples(generated.samples)
        is_root = jax.process_index() == 0
        here = samples if is_root else None
        term_advantages, term_weights = None, None
        if isinstance(self.reward, WeightedReward) and self.reward_combination == "normalize_each":
            terms = self.reward.terms
            components = np.stack([score_on_root(term, here, host_rows) for term, _ in terms])
            weights = np.array([weight for _, weight in terms])
            rewards = weights @ components
            advantages = per_reward_advantages(
                components, weights, self.groups, std=self.advantage_std
            )
            term_advantages = reward_advantages(components, self.groups, std=self.advantage_std)
            term_weights = tuple(float(weight) for weight in weights)
        else:
            rewards = score_on_root(self.reward, here, host_rows)
            advantages = group_advantages(rewards, self.groups, std=self.advantage_std)
        del samples, here
        grouped = rewards.reshape(-1, self.groups)
        zero_std_fraction = float(np.mean(np.all(grouped == grouped[:, :1], axis=1)))
        mean_group_std = float(np.mean(grouped.std(axis=1)))
        scored_at = time.perf_counter()
        batch = self.active_sampler.batch(draw, generated, advantages)
        info = RolloutInfo(
            rewards=rewards,
            reward_mean=np.float32(rewards.mean()),
            zero_std_fraction=zero_std_fraction,
            mean_group_std=mean_group_std,
            samples=generated.samples,
            final=generated.final,
            seconds={
                "generation": generated_at - started,
                "reward": scored_at - generated_at,
            },
            reward_calls_here=int(is_root),
            window_start=first,
            reward_advantages=term_advantages,
            reward_weights=term_weights,
        )
        return batch, info


@eqx.filter_jit
def _generate(
    sampler: AbstractSampler, draw: Draw, starts_per_group: int, key: PRNGKeyArray
) -> Generated:
    """Draw the starting noise and run the sampler's trajectory.

    Consecutive runs of `starts_per_group` rows share one starting draw (1: all independent).
    """
    latent_shape = draw.flow.inputs.latent_shape
    assert latent_shape is not None
    num = leading_rows(draw.rows)
    noise_key, step_key = jax.random.split(key)
    if starts_per_group == 1:
        start = jax.random.normal(noise_key, (num, *latent_shape), jnp.float32)
    else:
        draws = jax.random.normal(noise_key, (num // starts_per_group, *latent_shape), jnp.float32)
        start = jnp.repeat(draws, starts_per_group, axis=0)
    sharding = draw.sharding
    if sharding is not None:
        start = jax.lax.with_sharding_constraint(start, sharding)  # type: ignore[no-untyped-call]
    generated = sampler.trajectory(draw, start, step_key)
    if sharding is None:
        return generated
    constrained: Generated = jax.tree.map(
        lambda leaf: jax.lax.with_sharding_constraint(leaf, sharding),  # type: ignore[no-untyped-call]
        generated,
    )
    return constrained
