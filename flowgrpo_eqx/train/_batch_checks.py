"""The trainer's check of a batch's advantages: on the host before the update program runs
(`check_advantages`), or inside it when the update is traced (`finite_advantages`)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


NON_FINITE_ADVANTAGES = (
    "`batch.advantages` holds a NaN or infinite value: Trainer.update refuses it (it would "
    "make every trained parameter NaN); check the rewards and the advantage estimator."
)


def check_advantages(batch: Any) -> bool:
    """Check the batch's `advantages` (when it has float ones) on the host, before the update
    program runs and donates the caller's state.

    **Arguments:**

    - `batch`: the update's batch.

    **Returns:**

    `True` when there was nothing to check or the advantages were checked here; `False`
    when they are traced (`update` inside the caller's own `jax.jit`): the update program
    then checks them itself (`finite_advantages`).

    **Raises:**

    - `ValueError`: naming `batch.advantages`, if one of them is NaN or infinite.
    """
    advantages = getattr(batch, "advantages", None)
    if not isinstance(advantages, jax.Array | np.ndarray) or not jnp.issubdtype(
        advantages.dtype, jnp.inexact
    ):
        return True
    if isinstance(advantages, jax.core.Tracer):
        return False
    if isinstance(advantages, np.ndarray) or advantages.is_fully_addressable:
        # A copy of a few floats per row: nothing runs on the device, nothing waits for it
        # but the advantages themselves.
        finite = bool(np.isfinite(np.asarray(advantages)).all())
    else:
        # Rows on other processes too: every process computes the same replicated answer.
        finite = bool(np.asarray(all_finite(advantages).addressable_data(0)))
    if not finite:
        raise ValueError(NON_FINITE_ADVANTAGES)
    return True


@jax.jit
def all_finite(values: Array) -> Array:
    """Whether every entry of `values` is finite (jitted; replicated on every process).

    **Arguments:**

    - `values`: an array.

    **Returns:**

    A boolean scalar.
    """
    return jnp.all(jnp.isfinite(values))


def finite_advantages(batch: Any) -> Any:
    """`batch`, its `advantages` (when it has them) checked finite inside the traced update:
    one NaN advantage would turn every trained parameter NaN without a word. Only for an
    update traced inside the caller's own `jax.jit` (`check_advantages` checks concrete
    ones on the host, before the caller's state is donated).

    **Arguments:**

    - `batch`: the update's batch.

    **Returns:**

    `batch`, its float advantages behind an `eqx.error_if`.
    """
    advantages = getattr(batch, "advantages", None)
    if not isinstance(advantages, jax.Array) or not jnp.issubdtype(advantages.dtype, jnp.inexact):
        return batch
    checked = eqx.error_if(advantages, ~jnp.all(jnp.isfinite(advantages)), NON_FINITE_ADVANTAGES)
    return eqx.tree_at(lambda b: b.advantages, batch, checked)
