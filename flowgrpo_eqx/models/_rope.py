"""Rotary position features over several position axes (FLUX's and Wan's), as diffusers
computes them."""

from typing import Any

import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jaxtyping import Array, Float


_ROPE_THETA = 10_000.0


def rope_tables(
    ids: npt.NDArray[np.floating[Any]], axes_dims: tuple[int, ...], theta: float = _ROPE_THETA
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The rotary position features of `ids`, as diffusers' `FluxPosEmbed` computes them.

    For each position axis `i` of width `d_i`, the angles `ids[:, i] * theta ** (-2k / d_i)`
    for `k < d_i / 2` in float64, their cosines and sines each repeated twice in place (the
    pairs `(2k, 2k + 1)` share an angle), then float32; the axes are concatenated.

    **Arguments:**

    - `ids`: the positions, `[S, len(axes_dims)]`.
    - `axes_dims`: the feature width of each position axis (even), summing to the head
        width.
    - `theta`: the base of the frequencies.

    **Returns:**

    `(cos, sin)`, each `[S, sum(axes_dims)]` float32.
    """
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(ids[:, axis].astype(np.float32).astype(np.float64), freqs)
        cos.append(np.repeat(np.cos(angles), 2, axis=1))
        sin.append(np.repeat(np.sin(angles), 2, axis=1))
    return (
        np.concatenate(cos, axis=1).astype(np.float32),
        np.concatenate(sin, axis=1).astype(np.float32),
    )


def apply_rope(
    qkv: Float[Array, "3 S heads head_dim"],
    cos: Float[Array, "S head_dim"],
    sin: Float[Array, "S head_dim"],
) -> Float[Array, "3 S heads head_dim"]:
    """The queries and keys rotated by their positions (diffusers' `apply_rotary_emb`, in
    float32: each pair `(x_2k, x_2k+1)` becomes `x * cos + (-x_2k+1, x_2k) * sin`); the values
    as they are."""

    def rotate(x: Float[Array, "S heads head_dim"]) -> Float[Array, "S heads head_dim"]:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
        out = x.astype(jnp.float32) * cos[:, None, :] + turned.astype(jnp.float32) * sin[:, None, :]
        return out.astype(x.dtype)

    return jnp.stack([rotate(qkv[0]), rotate(qkv[1]), qkv[2]])
