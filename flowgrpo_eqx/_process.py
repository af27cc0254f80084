"""The rectified-flow process: interpolation, velocity target and the sampling time grid."""

import abc
import math
from typing import final

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._custom_types import Latent, ScalarLike
from ._misc import check_int, check_number


class AbstractProcess(eqx.Module):
    """A generative process that runs from noise at `t = 1` to data at `t = 0`.

    It says how training pairs are made (`interpolate`, `velocity_target`: flow-matching
    pretraining uses them) and on which time grid sampling runs (`timesteps`: the rollout,
    evaluation and previews use it).
    """

    @abc.abstractmethod
    def interpolate(self, data: Latent, noise: Latent, t: ScalarLike) -> Latent:
        """The noisy state `x_t` between `data` (t = 0) and `noise` (t = 1).

        **Arguments:**

        - `data`: one clean latent.
        - `noise`: one standard normal draw shaped like `data`.
        - `t`: the time, a scalar in [0, 1].

        **Returns:**

        `x_t`, shaped like `data`.
        """

    @abc.abstractmethod
    def velocity_target(self, data: Latent, noise: Latent) -> Latent:
        """The regression target for the velocity `dx_t / dt`.

        **Arguments:**

        - `data`: one clean latent.
        - `noise`: the noise it was interpolated with.

        **Returns:**

        The target velocity, shaped like `data`.
        """

    @abc.abstractmethod
    def timesteps(self, steps: int) -> Float[Array, " steps"]:
        """The sampling grid of `steps` time points from 1 down to 0.

        **Arguments:**

        - `steps`: the number of time points (`steps - 1` transitions).

        **Returns:**

        `[steps]` decreasing times, the first 1 and the last 0.
        """


class AbstractTimeGrid(eqx.Module):
    """Which points from 1 to 0 a `RectifiedFlow` shifts into its sampling grid:
    `UniformGrid` (the default), `DiffusersGrid` (SD3 and SD3.5 pipelines) or `FluxGrid`
    (`FluxPipeline`)."""

    @abc.abstractmethod
    def times(self, shift: float, steps: int) -> Float[Array, " steps"]:
        """The grid of `steps` float32 times, shifted by `shift`.

        **Arguments:**

        - `shift`: the time-shift `s`, `t = s u / (1 + (s - 1) u)`.
        - `steps`: the number of time points, >= 2.

        **Returns:**

        `[steps]` decreasing times, the first 1 and the last 0.
        """


@final
class UniformGrid(AbstractTimeGrid):
    """`steps` points evenly from 1 to 0, each shifted."""

    def times(self, shift: float, steps: int) -> Float[Array, " steps"]:
        uniform = jnp.linspace(1.0, 0.0, steps, dtype=jnp.float32)
        scaled = shift * uniform
        shifted = scaled / (scaled + (1 - uniform))
        # The SDE's first-step guard needs a first time of exactly 1. The form above gives it
        # where division is correctly rounded (the CPU), but a TPU's float32 `s / s` is
        # 0.99999994, so the endpoints are set rather than computed.
        grid: Float[Array, " steps"] = shifted.at[0].set(1.0).at[-1].set(0.0)
        return grid


@final
class DiffusersGrid(AbstractTimeGrid):
    """The grid of diffusers' SD3 and SD3.5 pipelines, the sigmas of
    `FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps - 1)`: `steps - 1`
    points evenly from 1 to `s_min`, the shift of `1/1000`, each shifted (so `s_min` is
    shifted twice), then a final 0. With `shift=3.0` and 11 points: 1, 0.96013, ...,
    0.27805, 0.00893, 0."""

    def times(self, shift: float, steps: int) -> Float[Array, " steps"]:
        # As diffusers' scheduler computes it, in float64 NumPy, then float32.
        s = float(shift)
        s_min = s * 1e-3 / (1 + (s - 1) * 1e-3)
        u = np.linspace(1.0, s_min, steps - 1)
        sigmas = np.append(s * u / (1 + (s - 1) * u), 0.0)
        return jnp.asarray(sigmas, dtype=jnp.float32)


@final
class FluxGrid(AbstractTimeGrid):
    """The grid of diffusers' `FluxPipeline`: `steps - 1` points evenly from 1 to
    `1 / (steps - 1)`, each shifted, then a final 0. FLUX.1-dev's scheduler shifts by
    `exp(mu)` with `mu` from the image's token count (its exponential time shift
    `e^mu / (e^mu + 1/u - 1)` is this shift with `s = e^mu`): `shift=flux_shift(tokens)`;
    FLUX.1-schnell's by 1."""

    def times(self, shift: float, steps: int) -> Float[Array, " steps"]:
        # As the pipeline and scheduler compute it: the evenly spaced sigmas in float32.
        s = float(shift)
        u = np.linspace(1.0, 1.0 / (steps - 1), steps - 1).astype(np.float32)
        u64 = u.astype(np.float64)
        return jnp.asarray(np.append(s * u64 / (1 + (s - 1) * u64), 0.0), dtype=jnp.float32)


@final
class RectifiedFlow(AbstractProcess):
    """Rectified flow: `x_t = (1 - t) x_0 + t eps`, velocity `eps - x_0`.

    `interpolate` returns `x_t` in the data's dtype, whatever the time's; `timesteps` returns a
    float32 grid whose first time is exactly 1 and last exactly 0.

    **Arguments:**

    - `shift`: the time-shift `s` of the grid, `t = s u / (1 + (s - 1) u)` for a uniform
        `u`. `1.0` (the default) keeps the uniform grid; SD3 uses `3.0`.
    - `grid`: which `u` are shifted, an `AbstractTimeGrid`: `UniformGrid()` (the default),
        `DiffusersGrid()` (the SD3 and SD3.5 pipelines' sigmas) or `FluxGrid()`
        (`FluxPipeline`'s, with `shift=flux_shift(tokens)` for FLUX.1-dev).

    **Raises:**

    - `ValueError`: naming `shift` if it is not a finite number `> 0`, or `grid` if it is
        not an `AbstractTimeGrid`; or, from `timesteps`, if `steps` is not an int >= 2.
    """

    shift: float = 1.0
    grid: AbstractTimeGrid = UniformGrid()

    def __check_init__(self) -> None:
        check_number("shift", self.shift, minimum=0, include_minimum=False)
        if not isinstance(self.grid, AbstractTimeGrid):
            raise ValueError(
                "`grid` must be an AbstractTimeGrid (UniformGrid, DiffusersGrid, FluxGrid), got "
                f"{self.grid!r}."
            )

    def interpolate(self, data: Latent, noise: Latent, t: ScalarLike) -> Latent:
        time = jnp.asarray(t, data.dtype)
        return (1 - time) * data + time * noise

    def velocity_target(self, data: Latent, noise: Latent) -> Latent:
        return noise - data

    def timesteps(self, steps: int) -> Float[Array, " steps"]:
        check_int("steps", steps, 2)
        return self.grid.times(self.shift, steps)


def flux_shift(
    image_tokens: int,
    base_tokens: int = 256,
    max_tokens: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The time shift FLUX.1-dev's pipeline gives an image of `image_tokens` packed tokens.

    diffusers' `calculate_shift`: `mu` linear in the token count, `base_shift` at
    `base_tokens` and `max_shift` at `max_tokens` (FLUX.1-dev's scheduler config), and the
    shift is `exp(mu)`: `RectifiedFlow(shift=flux_shift(tokens), grid=FluxGrid())` is its grid.
    A 512 x 512 image has `(512 / 16) ** 2 = 1024` tokens (shift about 1.87), 1024 x 1024 has
    4096 (shift `e^1.15`, about 3.16).

    **Arguments:**

    - `image_tokens`: the packed image's token count, `(H / 2) (W / 2)` of the latent.
    - `base_tokens`, `max_tokens`, `base_shift`, `max_shift`: the scheduler config's
        `base_image_seq_len`, `max_image_seq_len`, `base_shift`, `max_shift`.

    **Returns:**

    `exp(mu)`, a positive float.

    **Raises:**

    - `ValueError`: if `image_tokens` is not a positive int or `max_tokens == base_tokens`.
    """
    check_int("image_tokens", image_tokens, 1)
    if max_tokens == base_tokens:
        raise ValueError(f"`max_tokens` must differ from `base_tokens`, both {base_tokens}.")
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = image_tokens * slope + (base_shift - slope * base_tokens)
    return math.exp(mu)
