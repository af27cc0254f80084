"""`python -m tools.tpu.rope_variants`: Wan 2.1's (or FLUX.1's) step with the rotary
embedding's pairs turned another way, timed beside the library's on one accelerator.

The library rotates the queries and keys as diffusers writes it (`apply_rope` in
`models/_rope.py`): each pair `(x_2k, x_2k+1)` becomes `x * cos + (-x_2k+1, x_2k) * sin`, the
turned pairs taken apart on a last axis of 2 (`reshape(..., -1, 2)`). On a TPU v5e that
rotation took 219.9 ms of the 2,389.9 ms that `wan1.3b 480x832x33 b1`'s ops sum to
(`tools/tpu/op_sources.py`, docs/accelerators.md), several times what its bytes take. The
variants turn the pairs in the heads' own lanes and compute the same numbers:

- `roll`: each lane's partner is one lane over (`jnp.roll` by -1 for the even lanes, +1 for
  the odd ones), negated on the even lanes, chosen by the lane's parity;
- `swap_product`: the turned vector is the product with a signed permutation matrix (`-1` at
  `[2k+1, 2k]`, `1` at `[2k, 2k+1]`) at `"highest"` precision, exact since each output is
  one input times +-1.

Neither is the library's until it is faster, and then with its own tests.

    bash tools/tpu/run.sh python -m tools.tpu.rope_variants [--row ROW] [--calls 5] [--profile]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`) with
the library's rotation and with each variant, in one process (`--profile` adds each one's
device profile, with the time by the function that made the ops). Compare the variants' `ms`.
"""

import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from flowgrpo_eqx.models import _flux, _wan
from tools.tpu._compare import compare, swapped


Turn = Callable[[Float[Array, "S heads head_dim"]], Float[Array, "S heads head_dim"]]
"""`x -> (-x_1, x_0, -x_3, x_2, ...)` over the last axis: each pair turned a quarter."""

Rope = Callable[
    [Float[Array, "3 S heads head_dim"], Float[Array, "S head_dim"], Float[Array, "S head_dim"]],
    Float[Array, "3 S heads head_dim"],
]
"""`apply_rope`'s signature: the queries, keys and values stacked, and the tables."""


def turned_by_roll(x: Float[Array, "S heads head_dim"]) -> Float[Array, "S heads head_dim"]:
    """The pairs turned by shifting the lanes one over each way and choosing by parity."""
    even = jnp.arange(x.shape[-1]) % 2 == 0
    return jnp.where(even, -jnp.roll(x, -1, axis=-1), jnp.roll(x, 1, axis=-1))


def turned_by_product(x: Float[Array, "S heads head_dim"]) -> Float[Array, "S heads head_dim"]:
    """The pairs turned by a product with a signed permutation matrix, exactly."""
    width = x.shape[-1]
    swap = np.zeros((width, width), np.float32)
    swap[np.arange(1, width, 2), np.arange(0, width, 2)] = -1.0
    swap[np.arange(0, width, 2), np.arange(1, width, 2)] = 1.0
    return jnp.einsum(
        "shd,de->she",
        x,
        jnp.asarray(swap, x.dtype),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=x.dtype,
    )


def rope_turning_by(turn: Turn) -> Rope:
    """`apply_rope`'s function (the same float32 arithmetic) with the pairs turned by `turn`."""

    def apply(
        qkv: Float[Array, "3 S heads head_dim"],
        cos: Float[Array, "S head_dim"],
        sin: Float[Array, "S head_dim"],
    ) -> Float[Array, "3 S heads head_dim"]:
        def rotate(x: Float[Array, "S heads head_dim"]) -> Float[Array, "S heads head_dim"]:
            out = (
                x.astype(jnp.float32) * cos[:, None, :]
                + turn(x).astype(jnp.float32) * sin[:, None, :]
            )
            return out.astype(x.dtype)

        return jnp.stack([rotate(qkv[0]), rotate(qkv[1]), qkv[2]])

    return apply


VARIANTS: dict[str, Rope | None] = {
    "library": None,
    "roll": rope_turning_by(turned_by_roll),
    "swap_product": rope_turning_by(turned_by_product),
}
"""The rotations to time: `None` for the library's own."""


def model_rope(rope: Rope | None) -> AbstractContextManager[None]:
    """Within the block, Wan's and FLUX's rotary embedding is `rope` (the library's when
    `None`), put back after."""
    return swapped([_wan, _flux], "apply_rope", rope)


def main(argv: list[str] | None = None) -> int:
    variants = {name: functools.partial(model_rope, rope) for name, rope in VARIANTS.items()}
    return compare(
        "python -m tools.tpu.rope_variants",
        __doc__ or "",
        variants,
        argv,
        default_row="wan1.3b 480x832x33 b1",
    )


if __name__ == "__main__":
    sys.exit(main())
