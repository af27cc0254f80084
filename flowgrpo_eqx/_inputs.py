"""What conditions the model, classifier-free guidance, and the latent <-> sample autoencoders."""

import abc
from collections.abc import Callable
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._misc import check_number


@final
class InputSpec(eqx.Module):
    """Which fields of a batch row condition the model, and the null condition for guidance.

    A source row (and `Transitions.cond`) is any PyTree of arrays with a leading row axis.
    `InputSpec()` passes each row's conditioning to the model unchanged.

    **Arguments:**

    - `select`: `None` to pass the row unchanged; a key to pass `row[select]`; or a tuple of
        keys to pass the sub-dict `{k: row[k]}`. Other fields (e.g. ids a reward needs) are
        kept in the rows but never reach the model.
    - `null`: the null condition of ONE example, in the same structure, shapes and dtypes as
        the selected conditioning (before `encoder`). Required when guidance is on.
    - `encoder`: an optional frozen encoder applied to one example's selected conditioning
        (and to `null`) before the model sees it, e.g. a text encoder. It never trains.
    - `latent_shape`: the shape of one latent. Needed to sample from rows that carry only
        conditioning (prompt-only batches); batches of transitions carry it themselves.
    - `caption`: an optional host function from the (numpy) rows to one caption per row, used
        by previews.

    **Raises:**

    - `ValueError`: naming the argument, for a malformed `select` or `latent_shape`.
    """

    select: str | tuple[str, ...] | None = None
    null: PyTree[Any] = None
    encoder: Callable[[PyTree[Any]], PyTree[Any]] | None = None
    latent_shape: tuple[int, ...] | None = None
    caption: Callable[[PyTree[Any]], list[str]] | None = None

    def __check_init__(self) -> None:
        keys = self.select if isinstance(self.select, tuple) else (self.select,)
        if self.select is not None and not all(isinstance(k, str) for k in keys):
            raise ValueError(
                f"`select` must be None, a str or a tuple of str, got {self.select!r}."
            )
        if self.latent_shape is not None and not (
            isinstance(self.latent_shape, tuple)
            and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.latent_shape
            )
        ):
            raise ValueError(
                f"`latent_shape` must be a tuple of positive ints, got {self.latent_shape!r}."
            )

    @property
    def has_null(self) -> bool:
        """Whether a null condition is available for classifier-free guidance."""
        return self.null is not None

    def selected(self, rows: PyTree[Any]) -> PyTree[Any]:
        """The part of `rows` (batched or one example) that conditions the model.

        **Arguments:**

        - `rows`: a batch of rows (leading axis `N`) or one example.

        **Returns:**

        `rows` itself, `rows[select]`, or the sub-dict `{k: rows[k]}`, as `select` says.

        **Raises:**

        - `ValueError`: when `select` does not match the rows' structure.
        """
        if self.select is None:
            return rows
        try:
            if isinstance(self.select, str):
                return rows[self.select]
            return {key: rows[key] for key in self.select}
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(
                f"InputSpec.select={self.select!r} does not match the rows' structure "
                f"{jax.tree_util.tree_structure(rows)}."
            ) from error

    def condition(self, rows: PyTree[Any]) -> PyTree[Any]:
        """The model's conditioning for a batch of rows (leading axis `N`).

        **Arguments:**

        - `rows`: a batch of rows, leaves with a leading axis `N`.

        **Returns:**

        The selected conditioning, passed through `encoder` (vmapped) when there is one.

        **Raises:**

        - `ValueError`: when `select` does not match the rows' structure.
        """
        chosen = self.selected(rows)
        if self.encoder is None:
            return chosen
        return jax.vmap(self.encoder)(chosen)

    def null_condition(self, num_rows: int) -> PyTree[Any]:
        """The null condition, encoded and repeated for `num_rows` rows.

        **Arguments:**

        - `num_rows`: the size `N` of the leading axis to repeat it over.

        **Returns:**

        The null condition (through `encoder` when there is one) with a leading axis `N`.

        **Raises:**

        - `ValueError`: if no `null` condition was given.
        """
        if self.null is None:
            raise ValueError(
                "Classifier-free guidance needs a null condition: pass InputSpec(null=...)."
            )
        null = jax.tree.map(jnp.asarray, self.null)
        if self.encoder is not None:
            null = self.encoder(null)
        return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_rows, *leaf.shape)), null)


_GUIDANCE_KEY = "guidance"


Velocity = Float[Array, " B *latent"]
"""The model's velocities for a batch of rows, `[B, *latent]`."""


class AbstractGuidance(eqx.Module):
    """How the velocity is guided: classifier-free guidance (`CFG`, two branches per row) or
    a guidance-distilled model's own guidance input (`EmbeddedGuidance`, one).

    `GuidedFlow` gives a guidance the means to run the model (one branch, or the conditional
    and the null branch in one batched call) and the guidance chooses, and mixes the result.
    """

    @property
    @abc.abstractmethod
    def needs_null(self) -> bool:
        """Whether the model also runs on the null condition (`InputSpec.null`)."""

    @abc.abstractmethod
    def guided_velocity(
        self,
        one_branch: Callable[[PyTree[Any]], Velocity],
        with_null: Callable[[PyTree[Any]], tuple[Velocity, Velocity]],
        conditioning: PyTree[Any],
        rows: int,
    ) -> Velocity:
        """The guided velocity of a batch of rows.

        **Arguments:**

        - `one_branch`: the model's velocities given a conditioning for the rows.
        - `with_null`: the model's velocities given a conditioning for the rows and given
            the null condition, both in one batched call: `(conditional, unconditional)`.
        - `conditioning`: the rows' conditioning (selected and encoded, leading axis `rows`).
        - `rows`: the number of rows.

        **Returns:**

        `[rows, *latent]` velocities.

        **Raises:**

        - `ValueError`: when the conditioning does not suit the guidance (for
            `EmbeddedGuidance`, not a dict, or one that already has `"guidance"`).
        """


@final
class CFG(AbstractGuidance):
    """Classifier-free guidance: `v = v_null + scale (v_cond - v_null)`.

    Both branches run through the same model (the live policy, or the frozen reference for
    the KL term) in one batched call.

    **Arguments:**

    - `scale`: the guidance scale; 1 is the conditional model alone, 0 the unconditional.

    **Raises:**

    - `ValueError`: naming `scale` if it is not a finite number >= 0 (a bool is not).
    """

    scale: float = 3.0

    def __check_init__(self) -> None:
        check_number("scale", self.scale, minimum=0)

    @property
    def needs_null(self) -> bool:
        return True

    def guided_velocity(
        self,
        one_branch: Callable[[PyTree[Any]], Velocity],
        with_null: Callable[[PyTree[Any]], tuple[Velocity, Velocity]],
        conditioning: PyTree[Any],
        rows: int,
    ) -> Velocity:
        return self.combine(*with_null(conditioning))

    def combine(
        self, conditional: Float[Array, " *shape"], unconditional: Float[Array, " *shape"]
    ) -> Float[Array, " *shape"]:
        """Mix the two branches' velocities: `unconditional + scale (conditional - unconditional)`.

        **Arguments:**

        - `conditional`: the velocity given the rows' conditioning.
        - `unconditional`: the velocity given the null condition, same shape.

        **Returns:**

        The guided velocity, same shape.
        """
        return unconditional + self.scale * (conditional - unconditional)


@final
class EmbeddedGuidance(AbstractGuidance):
    """The guidance scale as a model input, for guidance-distilled models such as FLUX.1-dev.

    Such a model was distilled from its classifier-free-guided teacher and takes the scale as
    part of its condition (FLUX.1-dev embeds it as it embeds the time), so the guided
    velocity is one call per row, not two, and needs no null condition. Each row's
    conditioning (after `InputSpec`, a dict) gets the scale under the key `"guidance"`, where
    the models read it (`Flux` reads `cond["guidance"]`): what diffusers' `FluxPipeline`
    passes for its `guidance_scale` (3.5 by default).

    **Arguments:**

    - `scale`: the guidance scale given to the model (3.5 in FLUX.1-dev's pipeline).

    **Raises:**

    - `ValueError`: naming `scale` if it is not a finite number >= 0.
    """

    scale: float = 3.5

    def __check_init__(self) -> None:
        check_number("scale", self.scale, minimum=0)

    @property
    def needs_null(self) -> bool:
        return False

    def guided_velocity(
        self,
        one_branch: Callable[[PyTree[Any]], Velocity],
        with_null: Callable[[PyTree[Any]], tuple[Velocity, Velocity]],
        conditioning: PyTree[Any],
        rows: int,
    ) -> Velocity:
        return one_branch(self.condition(conditioning, rows))

    def condition(self, conditioning: PyTree[Any], rows: int) -> dict[str, Any]:
        """The rows' conditioning with the scale added under `"guidance"`.

        **Arguments:**

        - `conditioning`: the rows' conditioning, a dict of arrays with a leading axis.
        - `rows`: the number of rows.

        **Returns:**

        A new dict: `conditioning` and `"guidance"` -> `[rows]` float32 scales.

        **Raises:**

        - `ValueError`: when `conditioning` is not a dict, or already has `"guidance"`.
        """
        if not isinstance(conditioning, dict) or _GUIDANCE_KEY in conditioning:
            raise ValueError(
                f"EmbeddedGuidance adds {_GUIDANCE_KEY!r} to a dict conditioning without it, got "
                f"{jax.tree_util.tree_structure(conditioning)}: select the condition's fields "
                "with InputSpec(select=(...))."
            )
        return {**conditioning, _GUIDANCE_KEY: jnp.full((rows,), self.scale, jnp.float32)}


class AbstractAutoEncoder(eqx.Module):
    """Maps samples in [-1, 1] to latents and back, one unbatched example at a time.

    Subclass it for a real autoencoder (a VAE's encoder and decoder, frozen); the objective
    vmaps it over a batch and clips decoded samples to [-1, 1].
    """

    @abc.abstractmethod
    def encode(self, sample: Float[Array, " *sample"]) -> Float[Array, " *latent"]:
        """The latent of one sample.

        **Arguments:**

        - `sample`: one sample in [-1, 1], without a batch axis.

        **Returns:**

        Its latent.
        """

    @abc.abstractmethod
    def decode(self, latent: Float[Array, " *latent"]) -> Float[Array, " *sample"]:
        """The sample in [-1, 1] of one latent.

        **Arguments:**

        - `latent`: one latent, without a batch axis.

        **Returns:**

        Its sample, in [-1, 1].
        """


@final
class IdentityAutoEncoder(AbstractAutoEncoder):
    """Latents are the samples themselves; decoding clips them to [-1, 1]."""

    def encode(self, sample: Float[Array, " *sample"]) -> Float[Array, " *sample"]:
        return sample

    def decode(self, latent: Float[Array, " *latent"]) -> Float[Array, " *latent"]:
        return jnp.clip(latent, -1.0, 1.0)
