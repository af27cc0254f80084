"""The stochastic processes Flow-GRPO samples with and scores under.

Both rollout and rescoring use the same `FlowSDE` instance, so recorded log densities and
rescored ones agree.
"""

import math
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray


_WINDOW_TOLERANCE = 1e-6


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the SDE computes in: float32 at least, whatever the model's dtype."""
    return jnp.promote_types(dtype, jnp.float32)


@final
class FlowSDE(eqx.Module):
    """The Flow-GRPO SDE that turns a rectified-flow ODE into a Gaussian policy per step.

    Time runs from noise at `t = 1` to data at `t = 0`. For a transition `t -> t_next` with
    `dt = t_next - t < 0` and velocity `v` at `(x, t)`:

    - `kind="flow"` (Flow-GRPO): `sigma = a sqrt(t / (1 - t*))`, `t* = t_next` when `t == 1`
      and `t* = t` otherwise (so the first transition's std is exactly `a`);
      `mean = x (1 + sigma^2 dt / (2t)) + v (1 + sigma^2 (1 - t) / (2t)) dt`,
      `std = sigma sqrt(-dt)`.
    - `kind="cps"` (coefficients-preserving sampling, arXiv:2509.05952):
      `std = t_next sin(a pi / 2)`, `x0 = x - t v`, `x1 = x + (1 - t) v`,
      `mean = x0 (1 - t_next) + x1 sqrt(t_next^2 - std^2)`. Deterministic at `t_next = 0`.
      Unlike the released CPS code, which drops the `1 / (2 std^2)` factor so its "ratio" is
      not a likelihood ratio, `log_prob` here is the true Gaussian log density for both kinds.

    A transition outside the stochastic `window`, or with `noise_level == 0`, is deterministic:
    plain Euler `x + v dt` with std 0. Deterministic transitions carry no density and the
    objective gives them no policy loss.

    **Arguments:**

    - `noise_level`: `a` above; 0.7 by default as in Flow-GRPO.
    - `kind`: `"flow"` (default) or `"cps"`.
    - `window`: `None` (every transition stochastic) or `(start, stop)` times with
        `1 >= start > stop >= 0`: a transition `t -> t_next` is stochastic when it lies inside,
        `t <= start` and `t_next >= stop`. This is Flow-GRPO-Fast's / MixGRPO's window; use
        `window_for_indices` to place it on a grid.
    - `kl_weighting`: `"paper"` (default) for the conditional Gaussian KL of arXiv:2505.05470v5
        section 4, `mean_coords[(mu - mu_ref)^2] / (2 sigma^2 |dt|)`; `"released"` for the
        released `train_sd3.py` term `mean_coords[(mu - mu_ref)^2] / (2 sigma^2)`, which equals
        `|dt|` times the paper's KL and so weights late, short steps less.

    **Raises:**

    - `ValueError`: naming the argument, for a negative `noise_level`, an unknown `kind` or
        `kl_weighting`, or a `window` outside the grid `[0, 1]` or empty.
    """

    noise_level: float = 0.7
    kind: str = "flow"
    window: tuple[float, float] | None = None
    kl_weighting: str = "paper"

    def __check_init__(self) -> None:
        if not (isinstance(self.noise_level, (int, float)) and self.noise_level >= 0):
            raise ValueError(f"`noise_level` must be a number >= 0, got {self.noise_level!r}.")
        if self.kind == "cps" and self.noise_level > 1:
            raise ValueError(
                f"`noise_level` must be in [0, 1] for kind='cps', got {self.noise_level}."
            )
        if self.kind not in ("flow", "cps"):
            raise ValueError(f"`kind` must be 'flow' or 'cps', got {self.kind!r}.")
        if self.kl_weighting not in ("paper", "released"):
            raise ValueError(
                f"`kl_weighting` must be 'paper' or 'released', got {self.kl_weighting!r}."
            )
        if self.window is not None:
            if len(self.window) != 2:
                raise ValueError(f"`window` must be a pair (start, stop), got {self.window!r}.")
            start, stop = self.window
            if not (0.0 <= stop < start <= 1.0):
                raise ValueError(
                    "`window` must be (start, stop) times with 1 >= start > stop >= 0 (inside "
                    f"the grid from 1 to 0), got {self.window!r}."
                )

    @staticmethod
    def window_for_indices(
        timesteps: Float[ArrayLike, " steps"], first: int, count: int
    ) -> tuple[float, float]:
        """The `window` that makes transitions `first, ..., first + count - 1` of a grid stochastic.

        **Arguments:**

        - `timesteps`: the grid, e.g. `RectifiedFlow().timesteps(steps)`.
        - `first`: the index of the first stochastic transition.
        - `count`: how many consecutive transitions are stochastic.

        **Returns:**

        `(start, stop)` for `FlowSDE(window=...)`.

        **Raises:**

        - `ValueError`: if the transitions fall outside the grid.
        """
        grid = [float(t) for t in jnp.asarray(timesteps)]
        transitions = len(grid) - 1
        if not (0 <= first and count >= 1 and first + count <= transitions):
            raise ValueError(
                f"`first`={first} and `count`={count} select transitions outside the grid's "
                f"{transitions} transitions."
            )
        return (grid[first], grid[first + count])

    def is_stochastic(
        self, t: Float[ArrayLike, " *batch"], t_next: Float[ArrayLike, " *batch"]
    ) -> Bool[Array, " *batch"]:
        """Whether the transition `t -> t_next` samples noise (elementwise on arrays)."""
        t = jnp.asarray(t)
        t_next = jnp.asarray(t_next)
        stochastic = jnp.full(jnp.broadcast_shapes(t.shape, t_next.shape), self.noise_level > 0)
        if self.window is not None:
            start, stop = self.window
            stochastic = stochastic & (t <= start + _WINDOW_TOLERANCE)
            stochastic = stochastic & (t_next >= stop - _WINDOW_TOLERANCE)
        if self.kind == "cps":
            stochastic = stochastic & (t_next > 0)
        return stochastic

    def transition(
        self,
        x: Float[Array, " *latent"],
        v: Float[Array, " *latent"],
        t: Float[ArrayLike, ""],
        t_next: Float[ArrayLike, ""],
    ) -> tuple[Float[Array, " *latent"], Float[Array, ""]]:
        """The Gaussian transition `p(x_next | x)` of one unbatched latent.

        **Arguments:**

        - `x`: the latent at time `t`.
        - `v`: the (guided) velocity at `(x, t)`.
        - `t`, `t_next`: the transition's start and end times, `t_next < t`.

        **Returns:**

        `(mean, std)`: the mean shaped like `x` and the scalar std, both in float32 at least.
        `std` is 0 for a deterministic transition.
        """
        dtype = compute_dtype(jnp.result_type(x, v))
        x = x.astype(dtype)
        v = v.astype(dtype)
        t = jnp.asarray(t, dtype)
        t_next = jnp.asarray(t_next, dtype)
        level = jnp.where(self.is_stochastic(t, t_next), self.noise_level, 0.0).astype(dtype)
        dt = t_next - t
        if self.kind == "flow":
            t_star = jnp.where(t == 1, t_next, t)
            sigma = level * jnp.sqrt(t / (1 - t_star))
            sigma_sq = sigma**2
            mean = x * (1 + sigma_sq * dt / (2 * t)) + v * (1 + sigma_sq * (1 - t) / (2 * t)) * dt
            std = sigma * jnp.sqrt(-dt)
        else:
            std = t_next * jnp.sin(level * math.pi / 2)
            data_estimate = x - t * v
            noise_estimate = x + (1 - t) * v
            # sqrt(t_next^2 - std^2) = t_next cos(a pi / 2), without float32 cancellation.
            noise_scale = t_next * jnp.cos(level * math.pi / 2)
            mean = data_estimate * (1 - t_next) + noise_estimate * noise_scale
        return mean, std

    def sample(
        self, key: PRNGKeyArray, mean: Float[Array, " *latent"], std: Float[Array, ""]
    ) -> Float[Array, " *latent"]:
        """Draw `mean + std z` with `z ~ N(0, I)`."""
        return mean + std * jax.random.normal(key, mean.shape, mean.dtype)

    def log_prob(
        self,
        x_next: Float[Array, " *latent"],
        mean: Float[Array, " *latent"],
        std: Float[ArrayLike, ""],
    ) -> Float[Array, ""]:
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
        dtype = compute_dtype(jnp.result_type(x_next, mean))
        std = jnp.asarray(std, dtype)
        positive = std > 0
        safe_std = jnp.where(positive, std, 1.0)
        residual = x_next.astype(dtype) - mean.astype(dtype)
        per_coordinate = (
            -(residual**2) / (2 * safe_std**2) - jnp.log(safe_std) - 0.5 * math.log(2 * math.pi)
        )
        return jnp.where(positive, jnp.mean(per_coordinate), 0.0)

    def kl(
        self,
        mean: Float[Array, " *latent"],
        mean_ref: Float[Array, " *latent"],
        std: Float[ArrayLike, ""],
        dt: Float[ArrayLike, ""] | None = None,
    ) -> Float[Array, ""]:
        """The coordinate-averaged KL between two Gaussian transitions of equal std.

        With `kl_weighting="paper"`: `mean_coords[(mean - mean_ref)^2] / (2 std^2)`, where
        `std^2 = sigma^2 |dt|` includes the elapsed time. With `"released"`: `|dt|` times that.

        **Arguments:**

        - `mean`: the policy's transition mean.
        - `mean_ref`: the frozen reference's transition mean.
        - `std`: the shared std from `transition`.
        - `dt`: the elapsed time `t_next - t`; required for `kl_weighting="released"`.

        **Returns:**

        A scalar >= 0, exactly 0 when the means agree or the transition is deterministic.

        **Raises:**

        - `ValueError`: if `kl_weighting="released"` and `dt` is not given.
        """
        dtype = compute_dtype(jnp.result_type(mean, mean_ref))
        std = jnp.asarray(std, dtype)
        positive = std > 0
        safe_std = jnp.where(positive, std, 1.0)
        squared = jnp.mean((mean.astype(dtype) - mean_ref.astype(dtype)) ** 2)
        value = jnp.where(positive, squared / (2 * safe_std**2), 0.0)
        if self.kl_weighting == "released":
            if dt is None:
                raise ValueError("`dt` is required by FlowSDE.kl when kl_weighting='released'.")
            value = value * jnp.abs(jnp.asarray(dt, dtype))
        return value
