"""The property tests' own pieces: a tiny velocity model with its float64 NumPy statement,
objective configurations, and rollout-like batches whose next latents and log densities come
from the NumPy oracle (`tests/numpy_reference.py`), so building data compiles nothing.

The strategies, jitted evaluations and invariant assertions are the public ones of
`flowgrpo_eqx.testing`. Every jitted call compiles once per (objective static configuration,
shapes), so the configurations and the batch shapes are drawn from small fixed sets.
"""

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import flowgrpo_eqx as fg
from tests import numpy_reference as ref


COND_DIM = 2
HIDDEN = 8
KL_WEIGHTINGS = {"paper": fg.PaperKLWeighting(), "released": fg.ReleasedKLWeighting()}


# --------------------------------------------------------------------------------------
# A tiny model written here, not shipped by the library.


class TinyVelocity(eqx.Module):
    """`v = W2 tanh(W1 [x, t, cond] + b1) + b2 + c x` on one unbatched example."""

    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array
    skip: jax.Array

    def __init__(self, dim: int, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        fan_in = dim + 1 + COND_DIM
        self.w1 = jax.random.normal(k1, (HIDDEN, fan_in)) / math.sqrt(fan_in)
        self.b1 = 0.1 * jax.random.normal(k2, (HIDDEN,))
        self.w2 = jax.random.normal(k3, (dim, HIDDEN)) / math.sqrt(HIDDEN)
        self.b2 = 0.1 * jax.random.normal(k4, (dim,))
        self.skip = jnp.asarray(0.3)

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        features = jnp.concatenate([x, jnp.reshape(t, (1,)).astype(x.dtype), cond], axis=0)
        hidden = jnp.tanh(self.w1 @ features + self.b1)
        return self.w2 @ hidden + self.b2 + self.skip * x


def numpy_velocity(
    model: TinyVelocity, x: np.ndarray, t: np.ndarray, cond: np.ndarray
) -> np.ndarray:
    """The same model in float64 NumPy, batched over a leading axis."""
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in (model.w1, model.b1, model.w2, model.b2))
    features = np.concatenate([x, t[:, None], cond], axis=1)
    hidden = np.tanh(features @ w1.T + b1)
    return hidden @ w2.T + b2 + float(model.skip) * x


@functools.cache
def tiny_model(dim: int, seed: int = 0) -> TinyVelocity:
    return TinyVelocity(dim, jax.random.key(seed))


def perturbed(model: Any, scale: float = 0.05, seed: int = 1) -> Any:
    """A copy of `model` with every array leaf moved a little (a reference that differs)."""
    leaves, treedef = jax.tree.flatten(model)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        leaf + scale * jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf))
        for leaf, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)


# --------------------------------------------------------------------------------------
# Objective configurations.


def grid_of(steps: int, shift: float) -> np.ndarray:
    """The library's float32 grid (its own values, so a window placed on it is exact)."""
    return np.asarray(fg.RectifiedFlow(shift).timesteps(steps))


@dataclasses.dataclass(frozen=True)
class Config:
    """One objective configuration; the batch's transitions lie on `grid(steps, shift)`."""

    name: str
    kind: str = "flow"
    noise_level: float = 0.7
    steps: int = 5
    shift: float = 1.0
    window_indices: tuple[int, int] | None = None  # (first, count) on the grid
    guidance: float | None = None
    beta: float = 0.0
    kl_weighting: str = "paper"  # a key of KL_WEIGHTINGS
    clip_range: float = 0.2
    adv_clip_max: float = 5.0
    dim: int = 3

    @property
    def grid(self) -> np.ndarray:
        return grid_of(self.steps, self.shift)

    @property
    def window(self) -> tuple[float, float] | None:
        if self.window_indices is None:
            return None
        first, count = self.window_indices
        return fg.window_for_indices(jnp.asarray(self.grid), first, count)

    @property
    def sde(self) -> fg.AbstractSDE:
        sde_class = fg.FlowSDE if self.kind == "flow" else fg.CoefficientsPreservingSDE
        weighting = KL_WEIGHTINGS[self.kl_weighting]
        return sde_class(self.noise_level, window=self.window, kl_weighting=weighting)

    def objective(self, **overrides: Any) -> fg.FlowGRPOObjective:
        options: dict[str, Any] = dict(
            sde=self.sde,
            beta=self.beta,
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            guidance=None if self.guidance is None else fg.CFG(self.guidance),
            transition_chunk=None,
        )
        options.update(overrides)
        return fg.FlowGRPOObjective(
            tiny_model(self.dim),
            fg.RectifiedFlow(self.shift),
            fg.InputSpec(null=jnp.zeros((COND_DIM,), jnp.float32), latent_shape=(self.dim,)),
            **options,
        )

    def variables(self, obj: fg.FlowGRPOObjective) -> fg.FlowGRPOVariables:
        """Initial variables; with `beta > 0` the reference is moved so that KL > 0."""
        variables = obj.init(jax.random.key(0))
        if self.beta > 0:
            variables = fg.FlowGRPOVariables(variables.policy, perturbed(variables.reference))
        return variables

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


CONFIGS = (
    Config("flow", kind="flow", noise_level=0.7, steps=5, shift=3.0),
    Config(
        "flow-window-cfg-kl",
        kind="flow",
        noise_level=0.7,
        steps=6,
        shift=1.0,
        window_indices=(1, 2),
        guidance=2.0,
        beta=0.1,
    ),
    Config("cps-cfg", kind="cps", noise_level=0.5, steps=5, shift=1.0, guidance=1.5),
    Config(
        "cps-window-kl-released",
        kind="cps",
        noise_level=0.8,
        steps=7,
        shift=3.0,
        window_indices=(0, 3),
        beta=0.05,
        kl_weighting="released",
        clip_range=0.05,
    ),
)
BETA_FREE_CONFIGS = tuple(c for c in CONFIGS if c.beta == 0)


# --------------------------------------------------------------------------------------
# Independent NumPy statements (docs/mathematics/index.md §2, flow_grpo.md §5).


def kept_numpy(
    mask: np.ndarray,
    t: np.ndarray,
    t_next: np.ndarray,
    noise_level: float,
    kind: str,
    window: tuple[float, float] | None,
) -> np.ndarray:
    """The kept set: mask AND stochastic (the NumPy reference's stochastic set)."""
    kept: np.ndarray = np.asarray(mask, bool) & ref.stochastic(t, t_next, noise_level, kind, window)
    return kept


# --------------------------------------------------------------------------------------
# Rollout-like batches, built in NumPy.


@dataclasses.dataclass
class Rollout:
    batch: fg.Transitions
    indices: np.ndarray  # int [N, K]: the grid transition index of each entry
    kept: np.ndarray  # bool [N, K]: independent NumPy kept set
    std: np.ndarray  # [N, K]: float64 std of each transition
    own: np.ndarray  # [N, K]: float64 log density of each sample (0 where deterministic)


def make_rollout(
    config: Config,
    seed: int,
    rows: int,
    transitions: int,
    *,
    mask_p: float = 0.7,
    per_transition_advantages: bool = False,
    variables: fg.FlowGRPOVariables | None = None,
) -> Rollout:
    """A batch whose next latents are sampled from the configuration's own transitions.

    The velocity (with guidance) and the SDE step are computed in float64 NumPy from the
    policy's weights. `old_log_probs` are the sample's own log density plus N(0, 0.1^2) noise,
    so ratios are near 1 but not 1.
    """
    rng = np.random.default_rng(seed)
    n, k, d = rows, transitions, config.dim
    model = tiny_model(d) if variables is None else variables.policy
    indices = rng.integers(0, config.steps - 1, size=(n, k))
    t = config.grid[indices]
    t_next = config.grid[indices + 1]
    x = rng.normal(size=(n, k, d))
    cond = rng.normal(size=(n, COND_DIM))
    flat_x = x.reshape(n * k, d)
    flat_t = t.reshape(-1).astype(np.float64)
    flat_t_next = t_next.reshape(-1).astype(np.float64)
    flat_cond = np.repeat(cond, k, axis=0)
    v = numpy_velocity(model, flat_x, flat_t, flat_cond)
    if config.guidance is not None:
        v_null = numpy_velocity(model, flat_x, flat_t, np.zeros_like(flat_cond))
        v = v_null + config.guidance * (v - v_null)
    stochastic = kept_numpy(
        np.ones(n * k, bool), flat_t, flat_t_next, config.noise_level, config.kind, config.window
    )
    level = np.where(stochastic, config.noise_level, 0.0)
    mean, std = ref.gaussian(flat_x, v, flat_t, flat_t_next, level, config.kind)
    z = rng.normal(size=(n * k, d))
    x_next = mean + std[:, None] * z
    safe_std = np.where(std > 0, std, 1.0)
    own = np.where(
        std > 0,
        np.mean(-0.5 * z**2, axis=1) - np.log(safe_std) - 0.5 * math.log(2 * math.pi),
        0.0,
    )
    old = own.reshape(n, k) + 0.1 * rng.normal(size=(n, k))
    mask = rng.random(size=(n, k)) < mask_p
    advantages = rng.normal(size=(n, k) if per_transition_advantages else (n,))
    batch = fg.Transitions(
        latents=jnp.asarray(x, jnp.float32),
        next_latents=jnp.asarray(x_next.reshape(n, k, d), jnp.float32),
        timesteps=jnp.asarray(t, jnp.float32),
        next_timesteps=jnp.asarray(t_next, jnp.float32),
        old_log_probs=jnp.asarray(old, jnp.float32),
        transition_mask=jnp.asarray(mask),
        advantages=jnp.asarray(advantages, jnp.float32),
        cond=jnp.asarray(cond, jnp.float32),
    )
    kept = kept_numpy(mask, t, t_next, config.noise_level, config.kind, config.window)
    return Rollout(
        batch=batch, indices=indices, kept=kept, std=std.reshape(n, k), own=own.reshape(n, k)
    )


# --------------------------------------------------------------------------------------
# Strategies.

configs = st.sampled_from(CONFIGS)
beta_free_configs = st.sampled_from(BETA_FREE_CONFIGS)
