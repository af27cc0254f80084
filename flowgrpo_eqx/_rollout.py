"""`FlowRollout`: sample complete prompt groups, score them, and record what training needs."""

import time
from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ._advantages import AdvantageStd, RewardCombination, group_advantages, per_reward_advantages
from ._custom_types import FinalSamples, Model, Transitions
from ._distributed import host_samples, row_sharding, score_on_root, shard_batch
from ._guided_flow import GuidedFlow
from ._misc import check_int, is_int, leading_rows, repeat_rows
from ._reward import FlowReward, WeightedReward
from ._sde import AbstractSDE
from ._solver import AbstractSolver
from ._window import AbstractWindowSchedule


@final
class Generated(eqx.Module):
    """What one jit-compiled generation pass records (device arrays).

    **Arguments:**

    - `latents`, `next_latents`: `[N, K, *latent]` for the `K` recorded transitions (`None`
        with an ODE sampler).
    - `log_probs`: `[N, K]` their mean-coordinate log densities (`None` with an ODE sampler).
    - `means`: `[N, K, *latent]` the means of their Gaussians, when the rollout records them
        (`FlowRollout(record_means=True)`); `None` otherwise.
    - `final`: `[N, *latent]` the final latents at t = 0.
    - `samples`: `[N, *sample]` the decoded samples in [-1, 1].
    """

    latents: Float[Array, " N K *latent"] | None
    next_latents: Float[Array, " N K *latent"] | None
    log_probs: Float[Array, " N K"] | None
    final: Float[Array, " N *latent"]
    samples: Float[Array, " N *sample"]
    means: Float[Array, " N K *latent"] | None = None


@final
class RolloutInfo(eqx.Module):
    """Host-side diagnostics of one `collect`.

    **Arguments:**

    - `rewards`: `[N]` float64 rewards, exactly as the reward returned them.
    - `reward_mean`: the float32 mean reward (a diagnostic).
    - `zero_std_fraction`: the fraction of groups whose rewards are all equal.
    - `mean_group_std`: the mean over groups of the population reward std.
    - `samples`: `[N, *sample]` the decoded samples (device array).
    - `final`: `[N, *latent]` the final latents at t = 0 that `samples` decode (device
        array): what DiffusionNFT trains on.
    - `seconds`: wall time of `generation` (device work) and `reward` (host transfer,
        reward, float64 statistics, transport between processes).
    - `reward_calls_here`: how many times this process called the reward (1 on process 0,
        0 elsewhere).
    - `window_start`: the first recorded transition (a window schedule's position; 0
        without one).
    """

    rewards: npt.NDArray[np.float64]
    reward_mean: np.float32
    zero_std_fraction: float
    mean_group_std: float
    samples: Float[Array, " N *sample"]
    final: Float[Array, " N *latent"]
    seconds: dict[str, float]
    reward_calls_here: int
    window_start: int


@final
class FlowRollout(eqx.Module):
    """Sample complete prompt groups with a sampler, score them, and record what trains.

    Each source row is repeated `groups` times and forms one group (equal conditioning in
    other rows never merges groups). One jit-compiled `lax.scan` integrates the guided flow
    from N(0, I) noise on the `steps`-point grid of the flow's process:

    - with an SDE `sampler` (`FlowSDE`, `CoefficientsPreservingSDE`), it samples the SDE and
        records the first `train_steps` transitions and their log densities with the same
        code (`GuidedFlow.transition`) that `FlowGRPOObjective.log_probs` rescores with, and
        `collect` gives `Transitions`;
    - with an ODE `sampler` (`Euler`, `Heun`), it records nothing but the final latents, and
        `collect` gives `FinalSamples` (what DiffusionNFT trains on).

    The final latents are decoded to samples in [-1, 1], the reward runs once on the host,
    and advantages use the population group std with epsilon 1e-4 in float64 (cast to
    float32 after normalisation), as Flow-GRPO's `PerPromptStatTracker`. Deterministic
    transitions and every transition of a zero-advantage row are masked (not dropped:
    shapes stay static).

    **Arguments:**

    - `flow`: the `GuidedFlow` to sample (its model inputs, process, guidance, autoencoder);
        usually the objective's, `objective.flow`.
    - `sampler`: an `AbstractSDE` (transitions are recorded) or an `AbstractSolver` (only
        the final samples).
    - `reward`: a `FlowReward`.
    - `groups`: samples per source row.
    - `steps`: time points of the rollout grid; `steps=11` draws ten transitions.
    - `train_steps`: how many leading transitions to record (SDE only); `None` records all.
    - `advantage_std`: `"group"` (default) or `"global"` (the release's `global_std`).
    - `reward_combination`: `"sum"` (default) normalises the reward's scores within each
        group; `"normalize_each"` needs a `WeightedReward` and normalises each of its terms
        within its group before the weighted sum (`per_reward_advantages`), so no term's
        scale drowns the others. `RolloutInfo.rewards` is the weighted sum either way.
    - `window_schedule`: `None` (default) records the first `train_steps` transitions and
        leaves the stochastic ones to the SDE's `window`; or an `AbstractWindowSchedule`
        (`FixedWindow`, `RandomWindow`, `SlidingWindow`) that places, for each `collect`,
        `count` consecutive stochastic transitions (the others are ODE steps) and records
        exactly those. The position is a traced value: moving it never recompiles. Needs an
        SDE `sampler` with `window=None` and `train_steps=None`.
    - `record_means`: if `True` (SDE only), each recorded transition's Gaussian mean is kept
        as `Transitions.old_means`, which the released GRPO-Guard (`GRPOGuard`) needs for its
        drift term; `False` (default) records none (one latent-sized array less per
        transition).
    - `shared_noise`: if `True`, every sample of a group starts from the same N(0, I) draw
        (groups differ), so the group baseline compares sampler branches only (the
        release's `same_latent`); SDE samplers only, since an ODE sampler would draw one
        sample per group. `False` (default) draws every sample's start independently.
    - `mesh`: a data mesh (`flowgrpo_eqx.data_mesh()`) to shard rows over, or `None` for the
        default device. With many processes, every process calls `collect` with the same
        global rows; generation is collective, the reward runs on process 0 only, and the
        returned batch holds global arrays of which each process owns its rows.

    **Raises:**

    - `ValueError`: naming the argument, for a `sampler` that is neither an SDE nor an ODE
        solver, `groups < 1`, `steps < 2`, a `train_steps` outside `1..steps - 1` or with an
        ODE sampler, a recorded range with no stochastic transition, a
        `window_schedule` longer than the trajectory or beside `train_steps`, the SDE's
        `window` or an ODE sampler, or `shared_noise` with an ODE sampler and `groups > 1`.
    """

    flow: GuidedFlow
    sampler: AbstractSDE | AbstractSolver
    reward: FlowReward
    groups: int = 4
    steps: int = 11
    train_steps: int | None = None
    advantage_std: AdvantageStd = "group"
    reward_combination: RewardCombination = "sum"
    window_schedule: AbstractWindowSchedule | None = None
    shared_noise: bool = eqx.field(default=False, static=True)
    mesh: Mesh | None = eqx.field(default=None, static=True)
    record_means: bool = eqx.field(default=False, static=True)

    def __check_init__(self) -> None:
        if not isinstance(self.flow, GuidedFlow):
            raise ValueError(f"`flow` must be a GuidedFlow, got {self.flow!r}.")
        if not isinstance(self.sampler, (AbstractSDE, AbstractSolver)):
            raise ValueError(
                "`sampler` must be an AbstractSDE (transitions recorded) or an AbstractSolver "
                f"(final samples only), got {self.sampler!r}."
            )
        if not callable(self.reward):
            raise ValueError(
                f"`reward` must be callable as reward(samples, rows), got {self.reward!r}."
            )
        check_int("groups", self.groups, 1)
        check_int("steps", self.steps, 2)
        transitions = self.steps - 1
        if self.train_steps is not None and not (
            is_int(self.train_steps) and 1 <= self.train_steps <= transitions
        ):
            raise ValueError(
                f"`train_steps` must be None or an int in 1..{transitions} (steps={self.steps} "
                f"gives {transitions} transitions), got {self.train_steps!r}."
            )
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
        if not isinstance(self.shared_noise, bool):
            raise ValueError(f"`shared_noise` must be a bool, got {self.shared_noise!r}.")
        if self.advantage_std not in ("group", "global"):
            raise ValueError(
                f"`advantage_std` must be 'group' or 'global', got {self.advantage_std!r}."
            )
        if isinstance(self.sampler, AbstractSDE):
            self._check_sde_settings(self.sampler)
        else:
            self._check_ode_settings()

    def _check_ode_settings(self) -> None:
        """What an ODE `sampler` refuses: settings of recorded transitions, a shared start."""
        for name in ("train_steps", "window_schedule"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"`{name}` must be None with an ODE `sampler` (it records no "
                    f"transitions), got {getattr(self, name)!r}."
                )
        if self.shared_noise and self.groups > 1:
            raise ValueError(
                "`shared_noise` must be False with an ODE `sampler`: a deterministic "
                "sampler from one shared start draws the same sample for the whole group, "
                "so every advantage would be 0."
            )

    def _check_sde_settings(self, sde: AbstractSDE) -> None:
        """Where an SDE `sampler` records: a window schedule that fits, or a recorded range
        with a stochastic transition."""
        transitions = self.steps - 1
        if self.window_schedule is not None:
            if not isinstance(self.window_schedule, AbstractWindowSchedule):
                raise ValueError(
                    "`window_schedule` must be None or an AbstractWindowSchedule, got "
                    f"{self.window_schedule!r}."
                )
            if self.train_steps is not None:
                raise ValueError(
                    "`train_steps` must be None with a `window_schedule` (its `count` "
                    f"transitions are recorded), got {self.train_steps!r}."
                )
            if sde.window is not None:
                raise ValueError(
                    "The `sampler`'s `window` must be None with a `window_schedule` (the "
                    f"schedule places the noise), got {sde.window!r}."
                )
            self.window_schedule.check_fits(transitions)
            return
        grid = self.timesteps()
        recorded = self.recorded_transitions
        if not bool(jnp.any(sde.is_stochastic(grid[:recorded], grid[1 : recorded + 1]))):
            raise ValueError(
                f"`train_steps`={self.train_steps} records no stochastic transition under "
                f"the `sampler` (window={sde.window}, noise_level={sde.noise_level})."
            )

    @property
    def records_transitions(self) -> bool:
        """Whether `collect` records transitions (an SDE `sampler`) or not (an ODE one)."""
        return isinstance(self.sampler, AbstractSDE)

    @property
    def recorded_transitions(self) -> int:
        """`K`, the number of recorded transitions per sample (0 with an ODE `sampler`)."""
        if not self.records_transitions:
            return 0
        if self.window_schedule is not None:
            return self.window_schedule.count
        return self.steps - 1 if self.train_steps is None else self.train_steps

    def window_start(self, epoch: int, key: PRNGKeyArray) -> int:
        """The first recorded transition of a `collect` in `epoch` with `key`.

        **Arguments:**

        - `epoch`: the epoch, from 1.
        - `key`: the key passed to `collect`.

        **Returns:**

        The window schedule's position, or 0 without a schedule.
        """
        if self.window_schedule is None:
            return 0
        return self.window_schedule.first(epoch, self.steps - 1, key)

    def timesteps(self) -> Float[Array, " steps"]:
        """The rollout's time grid.

        **Returns:**

        `[steps]` times from 1 to 0, `flow.process.timesteps(steps)`.
        """
        return self.flow.process.timesteps(self.steps)

    def generate(
        self, policy: Model, rows: PyTree[Any], key: PRNGKeyArray, first: int = 0
    ) -> Generated:
        """Sample rows already repeated into groups: the recorded transitions (with an SDE
        `sampler`), their log densities, the final latents and the decoded samples.

        Jit-compiled, with static shapes.

        **Arguments:**

        - `policy`: the live policy.
        - `first`: with a `window_schedule`, the first recorded (and stochastic)
            transition, `window_start(epoch, key)`; traced, so any value reuses one
            compilation. Ignored without a schedule.
        - `rows`: `[N, ...]` conditioning rows, already repeated per group (`N` a multiple of
            `groups` when `shared_noise`).
        - `key`: the PRNG key for the starting noise and the SDE's noise.

        **Returns:**

        The `Generated` trajectory record.

        **Raises:**

        - `ValueError`: if the flow's `InputSpec` has no `latent_shape`, or if
            `shared_noise` and the rows are not whole groups.
        """
        if self.flow.inputs.latent_shape is None:
            raise ValueError(
                "FlowRollout needs the latent shape: pass InputSpec(latent_shape=...) to the "
                "objective (or the GuidedFlow)."
            )
        sharding = None if self.mesh is None else row_sharding(self.mesh)
        starts_per_group = self.groups if self.shared_noise else 1
        if leading_rows(rows) % starts_per_group:
            raise ValueError(
                f"`rows` must hold whole groups of {self.groups} with `shared_noise=True`, got "
                f"{leading_rows(rows)} rows."
            )
        return _generate(
            self.flow,
            self.sampler,
            self.steps,
            self.recorded_transitions,
            self.window_schedule is not None,
            starts_per_group,
            sharding,
            self.record_means and self.records_transitions,
            policy,
            rows,
            key,
            jnp.asarray(first, jnp.int32),
        )

    def collect(
        self, policy: Model, rows: PyTree[Any], key: PRNGKeyArray, epoch: int = 1
    ) -> tuple[Transitions | FinalSamples, RolloutInfo]:
        """Generate groups for the source `rows`, score them, and build the training batch.

        **Arguments:**

        - `policy`: the model that samples (for an RL objective,
            `objective.sampling_policy(variables)`). Never modified.
        - `rows`: the source rows, `[P, ...]` leaves (the structure `InputSpec` reads).
        - `key`: a PRNG key.
        - `epoch`: the epoch, from 1; places a `window_schedule`'s window (1 by default).

        **Returns:**

        `(batch, info)`: with an SDE `sampler`, a `Transitions` batch of `N = P * groups` rows
        and `K` recorded transitions; with an ODE one, the `FinalSamples` of those rows; and
        the host-side `RolloutInfo`.

        **Raises:**

        - `RewardError`: naming the reward, if it raises or returns a wrong shape, NaN or inf.
        """
        host_rows = repeat_rows(rows, self.groups)
        device_rows = self._place(host_rows)
        started = time.perf_counter()
        first = self.window_start(epoch, key)
        generated = self.generate(policy, device_rows, key, first)
        jax.block_until_ready(generated)  # type: ignore[no-untyped-call]
        generated_at = time.perf_counter()
        samples = host_samples(generated.samples)
        is_root = jax.process_index() == 0
        here = samples if is_root else None
        if isinstance(self.reward, WeightedReward) and self.reward_combination == "normalize_each":
            terms = self.reward.terms
            components = np.stack([score_on_root(term, here, host_rows) for term, _ in terms])
            weights = np.array([weight for _, weight in terms])
            rewards = weights @ components
            advantages = per_reward_advantages(
                components, weights, self.groups, std=self.advantage_std
            )
        else:
            rewards = score_on_root(self.reward, here, host_rows)
            advantages = group_advantages(rewards, self.groups, std=self.advantage_std)
        del samples, here
        grouped = rewards.reshape(-1, self.groups)
        zero_std_fraction = float(np.mean(np.all(grouped == grouped[:, :1], axis=1)))
        mean_group_std = float(np.mean(grouped.std(axis=1)))
        scored_at = time.perf_counter()
        batch: Transitions | FinalSamples
        if self.records_transitions:
            batch = self.build_batch(generated, device_rows, advantages, first)
        else:
            grid = np.asarray(self.timesteps())[:-1]
            batch = FinalSamples(
                latents=generated.final,
                advantages=self._place(np.asarray(advantages, np.float32)),
                cond=device_rows,
                timesteps=self._place(np.broadcast_to(grid, (len(advantages), grid.shape[0]))),
            )
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
        )
        return batch, info

    def _place(self, host: PyTree[Any]) -> PyTree[Any]:
        """Host rows as device arrays: row-sharded over the mesh, or on the default device."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, host)
        return shard_batch(host, self.mesh)

    def build_batch(
        self,
        generated: Generated,
        rows: PyTree[Any],
        advantages: npt.NDArray[np.float32],
        first: int = 0,
    ) -> Transitions:
        """The `Transitions` batch from a generation record and host advantages.

        The mask keeps stochastic transitions of rows with a non-zero advantage.

        **Arguments:**

        - `generated`: what `generate` recorded.
        - `rows`: the repeated rows on the device(s), `[N, ...]`.
        - `advantages`: `[N]` float32 advantages from `group_advantages`.
        - `first`: the first recorded transition (`window_start`; 0 without a schedule).

        **Returns:**

        The `Transitions` batch, placed like `rows` (row-sharded over `mesh` when given).

        **Raises:**

        - `ValueError`: if `generated` recorded no transitions (an ODE `sampler`).
        """
        if (
            generated.latents is None
            or generated.next_latents is None
            or generated.log_probs is None
            or not isinstance(self.sampler, AbstractSDE)
        ):
            raise ValueError("`generated` holds no transitions: the `sampler` is an ODE solver.")
        num = generated.log_probs.shape[0]
        grid = np.asarray(self.timesteps())
        recorded = self.recorded_transitions
        timesteps = np.broadcast_to(grid[first : first + recorded], (num, recorded))
        next_timesteps = np.broadcast_to(grid[first + 1 : first + recorded + 1], (num, recorded))
        stochastic = np.asarray(self.sampler.is_stochastic(timesteps, next_timesteps))
        host_advantages = np.asarray(advantages, np.float32)
        mask = stochastic & (host_advantages != 0)[:, None]
        placed = self._place(
            {
                "timesteps": timesteps,
                "next_timesteps": next_timesteps,
                "mask": mask,
                "advantages": host_advantages,
            }
        )
        return Transitions(
            latents=generated.latents,
            next_latents=generated.next_latents,
            timesteps=placed["timesteps"],
            next_timesteps=placed["next_timesteps"],
            old_log_probs=generated.log_probs,
            transition_mask=placed["mask"],
            advantages=placed["advantages"],
            cond=rows,
            old_means=generated.means,
        )


@eqx.filter_jit
def _generate(
    flow: GuidedFlow,
    sampler: AbstractSDE | AbstractSolver,
    steps: int,
    recorded: int,
    scheduled: bool,
    starts_per_group: int,
    sharding: NamedSharding | None,
    record_means: bool,
    policy: Model,
    rows: PyTree[Any],
    key: PRNGKeyArray,
    first: Int[Array, ""],
) -> Generated:
    """One `lax.scan` over the grid recording the first `recorded` transitions.

    Consecutive runs of `starts_per_group` rows share one starting draw (1: all independent).
    When `scheduled`, only transitions `first .. first + recorded - 1` draw noise and the
    whole trajectory is recorded, then those `recorded` transitions sliced out at the traced
    `first`. With an ODE `sampler` nothing is recorded.
    """
    latent_shape = flow.inputs.latent_shape
    assert latent_shape is not None
    num = leading_rows(rows)
    noise_key, step_key = jax.random.split(key)
    if starts_per_group == 1:
        start = jax.random.normal(noise_key, (num, *latent_shape), jnp.float32)
    else:
        draws = jax.random.normal(noise_key, (num // starts_per_group, *latent_shape), jnp.float32)
        start = jnp.repeat(draws, starts_per_group, axis=0)
    if sharding is not None:
        start = jax.lax.with_sharding_constraint(start, sharding)  # type: ignore[no-untyped-call]
    if isinstance(sampler, AbstractSolver):
        final = flow.sample_latents(policy, rows, start, sampler, steps)
        return _constrained(
            Generated(None, None, None, final=final, samples=flow.decode(final)), sharding
        )
    noise = _step_noise(step_key, steps, num, latent_shape, sharding)
    path = _SDEPath(flow, sampler, policy, rows, recorded, record_means)
    grid = flow.process.timesteps(steps)
    if scheduled:
        indices = jnp.arange(steps - 1)
        windowed = path.windowed(first)
        x, every = jax.lax.scan(windowed, start, (grid[:-1], grid[1:], noise, indices))
        recorded_arrays = jax.tree.map(
            lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, first, recorded, axis=0), every
        )
    else:
        head = (grid[:recorded], grid[1 : recorded + 1], noise[:recorded])
        x, recorded_arrays = jax.lax.scan(lambda x, xs: path.recording(x, xs), start, head)
        if recorded < steps - 1:
            tail = (grid[recorded:-1], grid[recorded + 1 :], noise[recorded:])
            x, _ = jax.lax.scan(lambda x, xs: path.silent(x, xs), x, tail)
    latents, next_latents, log_probs = recorded_arrays[:3]
    generated = Generated(
        latents=jnp.swapaxes(latents, 0, 1),
        next_latents=jnp.swapaxes(next_latents, 0, 1),
        log_probs=jnp.swapaxes(log_probs, 0, 1),
        final=x,
        samples=flow.decode(x),
        means=jnp.swapaxes(recorded_arrays[3], 0, 1) if record_means else None,
    )
    return _constrained(generated, sharding)


def _step_noise(
    step_key: PRNGKeyArray,
    steps: int,
    num: int,
    latent_shape: tuple[int, ...],
    sharding: NamedSharding | None,
) -> Float[Array, " steps_minus_one N *latent"]:
    """Every step's per-row noise, drawn from the per-step, per-row keys that a loop would
    split: the same values, but one batched draw (inside the scan body each draw cost two
    small rolled loops of tiny XLA ops per step on CPU)."""
    step_keys = jax.random.split(step_key, steps - 1)
    noise = jax.vmap(
        lambda k: jax.vmap(lambda r: jax.random.normal(r, latent_shape, jnp.float32))(
            jax.random.split(k, num)
        )
    )(step_keys)
    if sharding is not None:
        spec = PartitionSpec(None, *sharding.spec)  # type: ignore[no-untyped-call]
        per_step = NamedSharding(sharding.mesh, spec)
        noise = jax.lax.with_sharding_constraint(noise, per_step)  # type: ignore[no-untyped-call]
    noise_array: Array = noise
    return noise_array


class _SDEPath(eqx.Module):
    """The scan bodies of an SDE trajectory: a step that records, one that does not, and
    one that draws noise only inside a window starting at a traced `first`. (Its methods
    reach `lax.scan` through closures: a bound method of a module holding tracers cannot
    be hashed.)"""

    flow: GuidedFlow
    sde: AbstractSDE
    policy: Model
    rows: PyTree[Any]
    recorded: int = eqx.field(static=True)
    record_means: bool = eqx.field(static=True)

    def transition(
        self, x: Array, t: Array, t_next: Array, z: Array, allowed: Array | None = None
    ) -> tuple[Array, Array, Array]:
        num = x.shape[0]
        times = jnp.full((num,), t, x.dtype)
        next_times = jnp.full((num,), t_next, x.dtype)
        allowed_rows = None if allowed is None else jnp.full((num,), allowed)
        mean, std = self.flow.transition(
            self.sde, self.policy, x, times, next_times, self.rows, allowed_rows
        )
        x_next = jax.vmap(self.sde.sample)(mean, std, z)
        log_prob = jax.vmap(self.sde.log_prob)(x_next, mean, std)
        return x_next, log_prob, mean

    def record(self, x: Array, x_next: Array, log_prob: Array, mean: Array) -> tuple[Array, ...]:
        return (x, x_next, log_prob, mean) if self.record_means else (x, x_next, log_prob)

    def recording(
        self, x: Array, inputs: tuple[Array, Array, Array]
    ) -> tuple[Array, tuple[Array, ...]]:
        t, t_next, z = inputs
        x_next, log_prob, mean = self.transition(x, t, t_next, z)
        return x_next, self.record(x, x_next, log_prob, mean)

    def silent(self, x: Array, inputs: tuple[Array, Array, Array]) -> tuple[Array, None]:
        t, t_next, z = inputs
        x_next, _, _ = self.transition(x, t, t_next, z)
        return x_next, None

    def windowed(
        self, first: Int[Array, ""]
    ) -> Callable[[Array, tuple[Array, Array, Array, Array]], tuple[Array, tuple[Array, ...]]]:
        def step(
            x: Array, inputs: tuple[Array, Array, Array, Array]
        ) -> tuple[Array, tuple[Array, ...]]:
            t, t_next, z, index = inputs
            allowed = (index >= first) & (index < first + self.recorded)
            x_next, log_prob, mean = self.transition(x, t, t_next, z, allowed)
            return x_next, self.record(x, x_next, log_prob, mean)

        return step


def _constrained(generated: Generated, sharding: NamedSharding | None) -> Generated:
    if sharding is None:
        return generated
    constrained: Generated = jax.tree.map(
        lambda leaf: jax.lax.with_sharding_constraint(leaf, sharding),  # type: ignore[no-untyped-call]
        generated,
    )
    return constrained
