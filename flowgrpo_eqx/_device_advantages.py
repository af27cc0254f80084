"""Group statistics on the device, for rewards computed there (`flowgrpo_eqx.rewards`)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._advantages import AdvantageStd, check_normalisation


def device_group_advantages(
    scores: Float[Array, " N"],
    groups: int,
    eps: float = 1e-4,
    std: AdvantageStd = "group",
) -> Float[Array, " N"]:
    """`group_advantages` on the device, in float32, for scores that never leave it.

    The same statement, `A = (r - mean_group) / (std + eps)` with the population std of the
    group (or of the batch, `std="global"`) and exactly 0 for a constant group, computed in
    float32 (a TPU has no float64): the mean first, then the spread of the centred scores, so
    no large mean cancels digits. Against the float64 host statement the error is a few float32
    roundings of the centred score over the std: within `1e-5 * (1 + |r| / (std + eps))` of
    each row's advantage (`property_tests/test_device_advantages_properties.py`).

    **Arguments:**

    - `scores`: `[N]` scores, rows `p * groups ... p * groups + groups - 1` one group.
    - `groups`: the group size, an int >= 2 dividing `N`.
    - `eps`: added to the std.
    - `std`: `"group"` or `"global"`.

    **Returns:**

    `[N]` float32 advantages.

    **Raises:**

    - `ValueError`: naming `groups`, `scores`, `eps` or `std` when it is not one the host
        statement takes.
    - `EquinoxRuntimeError` (from `eqx.error_if`, at run time): naming `scores` when one is
        not finite.
    """
    if scores.ndim != 1:
        raise ValueError(f"`scores` must have shape [N], got {scores.shape}.")
    check_normalisation("scores", scores.shape[0], groups, eps, std)
    values = eqx.error_if(
        scores.astype(jnp.float32),
        ~jnp.all(jnp.isfinite(scores)),
        "`scores` holds a non-finite value.",
    )
    grouped = values.reshape(-1, groups)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if std == "group":
        spread = jnp.sqrt(jnp.mean(jnp.square(centred), axis=1, keepdims=True))
    else:
        overall = values - jnp.mean(values)
        spread = jnp.broadcast_to(jnp.sqrt(jnp.mean(jnp.square(overall))), (grouped.shape[0], 1))
    constant = jnp.all(grouped == grouped[:, :1], axis=1, keepdims=True)
    advantages = jnp.where(constant, 0.0, centred / (spread + eps))
    out: Float[Array, " N"] = advantages.reshape(-1)
    return out
