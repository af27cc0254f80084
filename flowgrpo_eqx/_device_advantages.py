"""Group statistics on the device, for rewards computed there (`flowgrpo_eqx.rewards`)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._advantages import AdvantageStd, check_normalisation, default_eps, std_ddof, std_is_global


def device_group_advantages(
    scores: Float[Array, " N"],
    groups: int,
    eps: float | None = None,
    std: AdvantageStd = "group",
) -> Float[Array, " N"]:
    """`group_advantages` on the device, in float32, for scores that never leave it.

    The same statement, `A = (r - mean_group) / (std + eps)` with the group's (or the
    batch's, `"global"`) population std, or the unbiased one (`"group_unbiased"`,
    `"global_unbiased"`), and exactly 0 for a constant group, computed in
    float32 (a TPU has no float64): the mean first, then the spread of the centred scores, so
    no large mean cancels digits. Against the float64 host statement the error is a few float32
    roundings of the centred score over the std: within `1e-5 * (1 + |r| / (std + eps))` of
    each row's advantage (`property_tests/test_device_advantages_properties.py`).

    **Arguments:**

    - `scores`: `[N]` scores, rows `p * groups ... p * groups + groups - 1` one group.
    - `groups`: the group size, an int >= 2 dividing `N`.
    - `eps`: added to the std; `None` (default) for `std`'s release value (`default_eps`).
    - `std`: an `AdvantageStd`.

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
    epsilon = default_eps(std) if eps is None else eps
    ddof = std_ddof(std)
    grouped = values.reshape(-1, groups)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if std_is_global(std):
        overall = values - jnp.mean(values)
        variance = jnp.sum(jnp.square(overall)) / (values.shape[0] - ddof)
        spread = jnp.broadcast_to(jnp.sqrt(variance), (grouped.shape[0], 1))
    else:
        variance = jnp.sum(jnp.square(centred), axis=1, keepdims=True) / (groups - ddof)
        spread = jnp.sqrt(variance)
    constant = jnp.all(grouped == grouped[:, :1], axis=1, keepdims=True)
    advantages = jnp.where(constant, 0.0, centred / (spread + epsilon))
    out: Float[Array, " N"] = advantages.reshape(-1)
    return out
