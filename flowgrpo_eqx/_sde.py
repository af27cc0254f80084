"""The stochastic processes Flow-GRPO samples with and scores under.

Both rollout and rescoring use the same SDE instance, so recorded log densities and rescored
ones agree. `docs/mathematics/index.md` states every formula here.
"""

import abc
import math
import numbers
from typing import TypeAlias, final

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ._custom_types import Latent, Scalar, ScalarLike
from ._misc import check_number


class AbstractKLWeighting(eqx.Module):
    """How an SDE weights the KL of one transition to the frozen reference's over time:
    `PaperKLWeighting` (the conditional Gaussian KL as it is) or `ReleasedKLWeighting`
    (`|dt|` times it, as the released code)."""

    @abc.abstractmethod
    def weigh(self, kl: Scalar, dt: ScalarLike | None, dtype: jnp.dtype) -> Scalar:
        """The weighted KL of one transition.

        **Arguments:**

        - `kl`: the conditional Gaussian KL, `mean_coords[(mean - mean_ref)^2] / (2 std^2)`.
        - `dt`: the elapsed time `t_next - t`, or `None` when the caller has none.
        - `dtype`: the computation's dtype.

        **Returns:**

        The weighted KL, a scalar >= 0.

        **Raises:**

        - `ValueError`: naming `dt` when the weighting needs it and it is `None`.
        """


@final
class PaperKLWeighting(AbstractKLWeighting):
    """The conditional Gaussian KL of arXiv:2505.05470v5 section 4, whose variance
    `sigma^2 |dt|` includes the elapsed time, unweighted: `mean_coords[(mu - mu_ref)^2] /
    (2 sigma^2 |dt|)`."""

    def weigh(self, kl: Scalar, dt: ScalarLike | None, dtype: jnp.dtype) -> Scalar:
        return kl


@final
class ReleasedKLWeighting(AbstractKLWeighting):
    """The released `train_sd3.py` term `mean_coords[(mu - mu_ref)^2] / (2 sigma^2)`: `|dt|`
    times the paper's KL, so late, short steps weigh less."""

    def weigh(self, kl: Scalar, dt: ScalarLike | None, dtype: jnp.dtype) -> Scalar:
        if dt is None:
            raise ValueError("`dt` is required by kl when kl_weighting=ReleasedKLWeighting().")
        weighted: Scalar = kl * jnp.abs(jnp.asarray(dt, dtype))
        return weighted


KLWeighting: TypeAlias = AbstractKLWeighting
"""An SDE's `kl_weighting`: `PaperKLWeighting()` or `ReleasedKLWeighting()`."""

_WINDOW_TOLERANCE = 1e-6


def compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
    """The dtype the SDE computes in: float64 if any input is 64-bit, else float32.

    Low-precision inputs (bfloat16, float16) are computed in float32. Chosen by width rather
    than by type promotion, so that it holds under strict dtype promotion too.
    """
    widest = max(jnp.dtype(dtype).itemsize for dtype in dtypes)
    chosen: jnp.dtype = jnp.dtype(jnp.float64 if widest >= 8 else jnp.float32)
    return chosen


def window_for_indices(
    timesteps: Float[ArrayLike, " steps"], first: int, count: int
) -> tuple[float, float]:
    """The `window` that makes transitions `first, ..., first + count - 1` of a grid stochastic.

    **Arguments:**

    - `timesteps`: the grid, e.g. `RectifiedFlow().timesteps(steps)`.
    - `first`: the index of the first stochastic transition.
    - `count`: how many consecutive transitions are stochastic.

    **Returns:**

    `(start, stop)` for the `window` of an SDE.

    **Raises:**

    - `ValueError`: naming `first` and `count` if the transitions fall outside the grid.
    """
    grid = [float(t) for t in jnp.asarray(timesteps)]
    transitions = len(grid) - 1
    if not (0 <= first and count >= 1 and first + count <= transitions):
        raise ValueError(
            f"`first`={first} and `count`={count} select transitions outside the grid's "
            f"{transitions} transitions."
        )
    return (grid[first], grid[first + count])


class AbstractSDE(eqx.Module):
    """A Gaussian policy per step of a rectified-flow trajectory, from noise (t = 1) to data.

    A concrete SDE supplies the Gaussian `(mean, std)` of a stochastic transition at a noise
    level, and where noise is possible at all; the window, the deterministic fallback (plain
    Euler `x + v dt`, std 0), sampling, the log density and the KL are shared here.

    A transition outside the stochastic `window`, or with `noise_level == 0`, is deterministic.
    Deterministic transitions carry no density and the objective gives them no policy loss.

    **Raises:**

    - `ValueError`: naming the argument, for a `noise_level` that is not a finite number
        `>= 0`, an unknown `kl_weighting`, or a `window` outside the grid `[0, 1]` or empty.
    """

    noise_level: eqx.AbstractVar[float]
    window: eqx.AbstractVar[tuple[float, float] | None]
    kl_weighting: eqx.AbstractVar[KLWeighting]

    def __check_init__(self) -> None:
        check_number("noise_level", self.noise_level, minimum=0)
        if not isinstance(self.kl_weighting, AbstractKLWeighting):
            raise ValueError(
                "`kl_weighting` must be PaperKLWeighting() or ReleasedKLWeighting(), got "
                f"{self.kl_weighting!r}."
            )
        if self.window is not None:
            if not isinstance(self.window, tuple) or len(self.window) != 2:
                raise ValueError(f"`window` must be a pair (start, stop), got {self.window!r}.")
            start, stop = self.window
            if not (0.0 <= stop < start <= 1.0):
                raise ValueError(
                    "`window` must be (start, stop) times with 1 >= start > stop >= 0 (inside "
                    f"the grid from 1 to 0), got {self.window!r}."
                )

    @abc.abstractmethod
    def gaussian(
        self, x: Latent, v: Latent, t: Scalar, t_next: Scalar, level: Scalar
    ) -> tuple[Latent, Scalar]:
        """The transition's `(mean, std)` at noise level `level` (0 on deterministic steps).

        At `level == 0` this must be the deterministic Euler step with std 0. `transition`
        calls it with the level already set to 0 outside the window.

        **Arguments:**

        - `x`: one latent at time `t`, in the compute dtype.
        - `v`: the (guided) velocity at `(x, t)`.
        - `t`, `t_next`: the transition's start and end times, `t_next < t`.
        - `level`: the noise level to use, `noise_level` or 0.

        **Returns:**

        `(mean, std)`: the mean shaped like `x` and the scalar std.
        """

    @abc.abstractmethod
    def can_be_stochastic(self, t_next: Float[Array, " *batch"]) -> Bool[Array, " *batch"]:
        """Where the sampler can draw noise at all, whatever the window.

        **Arguments:**

        - `t_next`: transition end times, any shape.

        **Returns:**

        A bool array shaped like `t_next`.
        """

    def is_stochastic(
        self, t: Float[ArrayLike, " *#batch"], t_next: Float[ArrayLike, " *#batch"]
    ) -> Bool[Array, " *#batch"]:
        """Whether the transition `t -> t_next` samples noise (elementwise on arrays).

        It does when `noise_level > 0`, it lies inside the `window` (`t <= start` and
        `t_next >= stop`, to a tolerance of 1e-6), and the sampler can draw noise there.

        **Arguments:**

        - `t`: transition start times.
        - `t_next`: transition end times, broadcastable with `t`.

        **Returns:**

        A bool array of their broadcast shape.
        """
        t = jnp.asarray(t)
        t_next = jnp.asarray(t_next)
        stochastic = jnp.full(jnp.broadcast_shapes(t.shape, t_next.shape), self.noise_level > 0)
        if self.window is not None:
            start, stop = self.window
            stochastic = stochastic & (t <= start + _WINDOW_TOLERANCE)
            stochastic = stochastic & (t_next >= stop - _WINDOW_TOLERANCE)
        return stochastic & self.can_be_stochastic(t_next)

    def transition(
        self,
        x: Latent,
        v: Latent,
        t: ScalarLike,
        t_next: ScalarLike,
        allowed: Bool[ArrayLike, ""] = True,
    ) -> tuple[Latent, Scalar]:
        """The Gaussian transition `p(x_next | x)` of one unbatched latent.

        **Arguments:**

        - `x`: the latent at time `t`.
        - `v`: the (guided) velocity at `(x, t)`.
        - `t`, `t_next`: the transition's start and end times, `t_next < t`.
        - `allowed`: `False` makes the transition deterministic even where `is_stochastic`
            holds (a rollout's window schedule, a traced value); `True` by default.

        **Returns:**

        `(mean, std)`: the mean shaped like `x` and the scalar std, both in float32 at least.
        `std` is 0 for a deterministic transition.
        """
        dtype = compute_dtype(x.dtype, v.dtype)
        start = jnp.asarray(t, dtype)
        end = jnp.asarray(t_next, dtype)
        stochastic = self.is_stochastic(start, end) & jnp.asarray(allowed)
        level = jnp.where(stochastic, self.noise_level, 0.0).astype(dtype)
        return self.gaussian(x.astype(dtype), v.astype(dtype), start, end, level)

    def sample(self, mean: Latent, std: ScalarLike, noise: Latent) -> Latent:
        """Draw `mean + std z` from a standard normal draw `z` shaped like `mean`.

        The draw is an argument so that a rollout can make all its draws in one batched call.

        **Arguments:**

        - `mean`, `std`: the transition's Gaussian, from `transition`.
        - `noise`: a standard normal draw `z` shaped like `mean`.

        **Returns:**

        `mean + std z` in `mean`'s dtype; `mean` itself on a deterministic transition.
        """
        return mean + jnp.asarray(std, mean.dtype) * noise.astype(mean.dtype)

    def log_prob(self, x_next: Latent, mean: Latent, std: ScalarLike) -> Scalar:
        """The mean-coordinate Gaussian log density of `x_next`, as the released code uses.

        `mean over coordinates of [-(x_next - mean)^2 / (2 std^2) - log std - log(2 pi) / 2]`:
        the policy ratio built from it is the geometric mean of the coordinate likelihood
        ratios, not their product.

        **Arguments:**

        - `x_next`: the sampled latent.
        - `mean`, `std`: the transition's Gaussian, from `transition`.

        **Returns:**

        A float32 (at least) scalar; 0 for a deterministic transition (`std == 0`), which has
        no density.
        """
        dtype = compute_dtype(x_next.dtype, mean.dtype)
        std = jnp.asarray(std, dtype)
        positive = std > 0
        safe_std = jnp.where(positive, std, 1.0)
        residual = x_next.astype(dtype) - mean.astype(dtype)
        per_coordinate = (
            -(residual**2) / (2 * safe_std**2) - jnp.log(safe_std) - 0.5 * math.log(2 * math.pi)
        )
        return jnp.where(positive, jnp.mean(per_coordinate), 0.0)

    def kl(
        self, mean: Latent, mean_ref: Latent, std: ScalarLike, dt: ScalarLike | None = None
    ) -> Scalar:
        """The coordinate-averaged KL between two Gaussian transitions of equal std.

        With `PaperKLWeighting()`: `mean_coords[(mean - mean_ref)^2] / (2 std^2)`, where
        `std^2 = sigma^2 |dt|` includes the elapsed time. With `ReleasedKLWeighting()`: `|dt|`
        times that.

        **Arguments:**

        - `mean`: the policy's transition mean.
        - `mean_ref`: the frozen reference's transition mean.
        - `std`: the shared std from `transition`.
        - `dt`: the elapsed time `t_next - t`; required by `ReleasedKLWeighting`.

        **Returns:**

        A scalar >= 0, exactly 0 when the means agree or the transition is deterministic.

        **Raises:**

        - `ValueError`: naming `dt` if the weighting is `ReleasedKLWeighting` and `dt` is
            not given.
        """
        dtype = compute_dtype(mean.dtype, mean_ref.dtype)
        std = jnp.asarray(std, dtype)
        positive = std > 0
        safe_std = jnp.where(positive, std, 1.0)
        squared = jnp.mean((mean.astype(dtype) - mean_ref.astype(dtype)) ** 2)
        value = jnp.where(positive, squared / (2 * safe_std**2), 0.0)
        return self.kl_weighting.weigh(value, dt, dtype)


@final
class FlowSDE(AbstractSDE):
    """The Flow-GRPO SDE that turns a rectified-flow ODE into a Gaussian policy per step.

    For a transition `t -> t_next` with `dt = t_next - t < 0`, velocity `v` at `(x, t)` and
    noise level `a`: `sigma = a sqrt(t / (1 - t*))` with `t* = t_next` when `t == 1` and
    `t* = t` otherwise (so the first transition's std is exactly `a`),
    `mean = x (1 + sigma^2 dt / (2t)) + v (1 + sigma^2 (1 - t) / (2t)) dt`,
    `std = sigma sqrt(-dt)`. It can draw noise on every transition: `can_be_stochastic` is
    true everywhere.

    **Arguments:**

    - `noise_level`: `a` above; 0.7 by default as in Flow-GRPO.
    - `window`: `None` (every transition stochastic) or `(start, stop)` times with
        `1 >= start > stop >= 0`: a transition `t -> t_next` is stochastic when it lies inside,
        `t <= start` and `t_next >= stop`. This is Flow-GRPO-Fast's fixed window (one that
        moves, as MixGRPO's, is a window schedule: `ProgressiveWindow`); use
        `window_for_indices` to place it on a grid.
    - `kl_weighting`: `PaperKLWeighting()` (default) for the conditional Gaussian KL of
        arXiv:2505.05470v5 section 4, `mean_coords[(mu - mu_ref)^2] / (2 sigma^2 |dt|)`;
        `ReleasedKLWeighting()` for the released `train_sd3.py` term `mean_coords[(mu -
        mu_ref)^2] / (2 sigma^2)`, which equals `|dt|` times the paper's KL and so weights
        late, short steps less.

    **Raises:**

    - `ValueError`: naming the argument, as `AbstractSDE`.
    """

    noise_level: float = 0.7
    window: tuple[float, float] | None = None
    kl_weighting: KLWeighting = PaperKLWeighting()

    def gaussian(
        self, x: Latent, v: Latent, t: Scalar, t_next: Scalar, level: Scalar
    ) -> tuple[Latent, Scalar]:
        dt = t_next - t
        t_star = jnp.where(t == 1, t_next, t)
        sigma = level * jnp.sqrt(t / (1 - t_star))
        sigma_sq = sigma**2
        mean = x * (1 + sigma_sq * dt / (2 * t)) + v * (1 + sigma_sq * (1 - t) / (2 * t)) * dt
        return mean, sigma * jnp.sqrt(-dt)

    def can_be_stochastic(self, t_next: Float[Array, " *batch"]) -> Bool[Array, " *batch"]:
        return jnp.ones(t_next.shape, bool)


@final
class CoefficientsPreservingSDE(AbstractSDE):
    """Coefficients-preserving sampling (CPS, arXiv:2509.05952) as a Gaussian policy.

    For a transition `t -> t_next` with velocity `v` and noise level `a`:
    `std = t_next sin(a pi / 2)`, `x0 = x - t v`, `x1 = x + (1 - t) v`,
    `mean = x0 (1 - t_next) + x1 sqrt(t_next^2 - std^2)`. The last step, to the data at
    `t_next = 0`, is deterministic: `can_be_stochastic` is `t_next > 0`.
    Unlike the released CPS code, which drops the `1 / (2 std^2)` factor so its "ratio" is
    not a likelihood ratio, `log_prob` here is the true Gaussian log density.

    **Arguments:**

    - `noise_level`: `a` above, in [0, 1]; 0.7 by default.
    - `window`, `kl_weighting`: as for `FlowSDE`.

    **Raises:**

    - `ValueError`: naming the argument, as `AbstractSDE`, or for a `noise_level` above 1.
    """

    noise_level: float = 0.7
    window: tuple[float, float] | None = None
    kl_weighting: KLWeighting = PaperKLWeighting()

    def __check_init__(self) -> None:
        if isinstance(self.noise_level, numbers.Real) and self.noise_level > 1:
            raise ValueError(
                "`noise_level` must be in [0, 1] for coefficients-preserving sampling, got "
                f"{self.noise_level}."
            )

    def gaussian(
        self, x: Latent, v: Latent, t: Scalar, t_next: Scalar, level: Scalar
    ) -> tuple[Latent, Scalar]:
        std = t_next * jnp.sin(level * math.pi / 2)
        data_estimate = x - t * v
        noise_estimate = x + (1 - t) * v
        # sqrt(t_next^2 - std^2) = t_next cos(a pi / 2), without float32 cancellation.
        noise_scale = t_next * jnp.cos(level * math.pi / 2)
        return data_estimate * (1 - t_next) + noise_estimate * noise_scale, std

    def can_be_stochastic(self, t_next: Float[Array, " *batch"]) -> Bool[Array, " *batch"]:
        return t_next > 0
