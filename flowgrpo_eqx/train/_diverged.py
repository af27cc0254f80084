"""`TrainingDiverged`: a non-finite loss, gradient norm or parameter stops training by name."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree


class TrainingDiverged(FloatingPointError):
    """Training produced a non-finite loss, gradient norm or parameter.

    Raised by `rl_epoch` (and so by the demo, which then keeps its last good checkpoint and
    writes no policy) at the end of the epoch in which it happened; what the epoch computed
    is not kept.

    **Arguments:**

    - `epoch`: the epoch that diverged, from 1.
    - `metrics`: that epoch's mean metrics (their non-finite values included).
    - `what`: what was not finite, e.g. `"loss"` or `"the policy's parameters"`.
    """

    def __init__(self, epoch: int, metrics: dict[str, float], what: str):
        self.epoch = epoch
        self.metrics = metrics
        self.what = what
        shown = ", ".join(f"{name}={value:.4g}" for name, value in sorted(metrics.items()))
        super().__init__(
            f"Training diverged in epoch {epoch}: {what} is not finite ({shown}). Lower the "
            "learning rate or the clip, or check the reward; the last checkpoint before this "
            "epoch is intact."
        )


@eqx.filter_jit
def _all_finite(tree: PyTree[Any]) -> Bool[Array, ""]:
    leaves = [leaf for leaf in jax.tree.leaves(tree) if eqx.is_inexact_array(leaf)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def check_finite(epoch: int, metrics: dict[str, float], policy: PyTree[Any]) -> None:
    """Raise `TrainingDiverged` unless the loss, the gradient norm and the policy are finite.

    **Arguments:**

    - `epoch`: the epoch the metrics are of.
    - `metrics`: its mean metrics (`loss` and `grad_norm` are checked when present).
    - `policy`: the policy after the epoch's updates.

    **Raises:**

    - `TrainingDiverged`: naming what is not finite, with the epoch and the metrics.
    """
    for name in ("loss", "grad_norm"):
        if name in metrics and not math.isfinite(metrics[name]):
            raise TrainingDiverged(epoch, metrics, name)
    if not bool(_all_finite(policy)):
        raise TrainingDiverged(epoch, metrics, "the policy's parameters")
