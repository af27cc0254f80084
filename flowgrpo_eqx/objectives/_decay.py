"""The decay by which a trailing copy of the policy follows the live one once per epoch:
DiffusionNFT's old policy, AWM's EMA and DGPO's EMA reference, `copy = eta copy + (1 - eta)
live`."""

from typing import final

import equinox as eqx

from .._misc import check_int, check_number


@final
class RampedDecay(eqx.Module):
    """The released old-policy decay: `eta = 0` for the first `flat` optimizer steps, then
    `min((step - flat) * rate, maximum)`, with `step` the optimizer steps done when the epoch
    ends. The old policy becomes `eta * old + (1 - eta) * live`.

    The defaults are the release's `decay_type=1`; its `decay_type=2` (OCR) is
    `RampedDecay(rate=0.0075, maximum=0.999, flat=75)`.

    **Arguments:**

    - `rate`: the increase of `eta` per optimizer step (>= 0).
    - `maximum`: the cap of `eta`, in [0, 1).
    - `flat`: optimizer steps with `eta = 0` (>= 0).

    **Raises:**

    - `ValueError`: naming the argument outside its range.
    """

    rate: float = 0.001
    maximum: float = 0.5
    flat: int = 0

    def __check_init__(self) -> None:
        check_number("rate", self.rate, minimum=0)
        check_number("maximum", self.maximum, minimum=0, maximum=1, include_maximum=False)
        check_int("flat", self.flat, 0)

    def __call__(self, step: int) -> float:
        """`eta` after `step` optimizer updates.

        **Arguments:**

        - `step`: the optimizer updates done when the epoch ended.

        **Returns:**

        The decay `eta` in [0, maximum].
        """
        if step < self.flat:
            return 0.0
        return min((step - self.flat) * self.rate, self.maximum)


def check_decay(name: str, value: float | RampedDecay | None) -> None:
    """Refuse a constant decay outside [0, 1) (a `RampedDecay` checks itself; `None`, no
    decay, passes).

    **Arguments:**

    - `name`: the argument's name, for the message.
    - `value`: the decay, or `None`.

    **Raises:**

    - `ValueError`: naming `name`, for a constant that is not a finite number in [0, 1).
    """
    if not isinstance(value, RampedDecay):
        check_number(name, value, minimum=0, maximum=1, include_maximum=False, optional=True)


def decay_at(decay: float | RampedDecay, step: int) -> float:
    """The decay `eta` after `step` optimizer updates.

    **Arguments:**

    - `decay`: a constant, or a `RampedDecay`.
    - `step`: the optimizer updates done (read by a `RampedDecay` alone).

    **Returns:**

    `decay(step)` for a `RampedDecay`, else `decay` itself.
    """
    return decay(step) if isinstance(decay, RampedDecay) else decay
