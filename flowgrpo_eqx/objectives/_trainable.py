"""The policy's trainable part: chosen once by a filter, then held by the optimizer, the EMA,
an old policy and the KL reference alike.

A *part* is a PyTree shaped like the policy with the trainable arrays as leaves and `None`
everywhere else (what `eqx.partition` gives). Whatever holds a copy of the trainable
parameters (the optimizer's state, `TrainState.ema`, `NFTVariables.old_policy`, the frozen
KL reference) holds a part, and `with_part(policy, part)` puts it back on the policy: so a
filter that trains LoRA adapters and some base weights together moves both everywhere.

The KL reference is the initial policy with its LoRA adapters switched off, as the released
trainers compare with (`reference_policy`): it keeps a frozen copy of the trainable arrays
that are not adapters (`reference_part`: every float array of a fully trained policy,
nothing for a policy whose adapters alone train).
"""

from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import equinox as eqx
import jax
from jaxtyping import PyTree

from .. import lora
from .._buffer import freeze_buffers
from .._misc import present_mask


_Model = TypeVar("_Model")

TrainableFilter: TypeAlias = Callable[[Any], bool] | PyTree[bool]
"""An Equinox filter over a policy's leaves: a callable on leaves, or a PyTree of bools shaped
like the policy."""


def default_trainable(policy: Any) -> TrainableFilter:
    """The trainable filter used when none is given.

    **Arguments:**

    - `policy`: the live policy.

    **Returns:**

    `lora.adapter_filter(policy)` for a policy with LoRA adapters (the adapters train, the
    base weights stay frozen), else `eqx.is_inexact_array` (every float array trains).
    """
    return lora.adapter_filter(policy) if lora.has_adapters(policy) else eqx.is_inexact_array


def split_trainable(
    policy: Any, trainable: TrainableFilter | None = None
) -> tuple[PyTree[Any], PyTree[Any]]:
    """`(part, frozen)`: the policy's trainable part and the rest.

    The part holds the floating-point arrays the filter selects outside any `Buffer` (a
    model's fixed array, such as a position table); everything else, including whatever
    non-array leaves (activations, static settings) the filter selects, stays in the frozen
    part, so `eqx.combine(part, frozen)` is the whole policy.

    **Arguments:**

    - `policy`: the live policy.
    - `trainable`: the filter; `default_trainable(policy)` when `None`.

    **Returns:**

    Two PyTrees shaped like `policy`, with `None` where the other one has the leaf.
    """
    filter_spec = default_trainable(policy) if trainable is None else trainable
    selected, unselected = eqx.partition(policy, freeze_buffers(filter_spec, policy))
    part, selected_static = eqx.partition(selected, eqx.is_inexact_array)
    return part, eqx.combine(unselected, selected_static)


def trainable_part(policy: Any, trainable: TrainableFilter | None = None) -> PyTree[Any]:
    """The policy's trainable part alone (`split_trainable(policy, trainable)[0]`).

    **Arguments:**

    - `policy`: the live policy.
    - `trainable`: the filter; `default_trainable(policy)` when `None`.

    **Returns:**

    A PyTree shaped like `policy`: the trainable arrays, `None` elsewhere.
    """
    return split_trainable(policy, trainable)[0]


def with_part(policy: _Model, part: PyTree[Any]) -> _Model:
    """`policy` with the arrays of `part` in place of its own.

    **Arguments:**

    - `policy`: a policy.
    - `part`: a part of a policy of the same structure (a `trainable_part`, an EMA of one).

    **Returns:**

    The policy carrying `part`'s arrays where `part` has arrays, its own elsewhere.
    """
    combined: _Model = eqx.combine(part, policy)
    return combined


def part_like(policy: Any, part: PyTree[Any]) -> PyTree[Any]:
    """The arrays of `policy` at the places where `part` has arrays.

    **Arguments:**

    - `policy`: a policy.
    - `part`: a part of a policy of the same structure.

    **Returns:**

    A part shaped like `part`, holding `policy`'s arrays.
    """
    return eqx.filter(policy, present_mask(part))


def blend_part(part: PyTree[Any], policy: Any, decay: Any) -> PyTree[Any]:
    """A part moved towards the policy's own arrays: `decay * part + (1 - decay) * live`.

    What an old policy (DiffusionNFT) or a slow EMA (AWM's KL anchor) does once per epoch.

    **Arguments:**

    - `part`: a part of a policy of the same structure (a `trainable_part`).
    - `policy`: the live policy, whose arrays at `part`'s places are `live`.
    - `decay`: the weight kept on `part`, in [0, 1].

    **Returns:**

    A part shaped like `part`.
    """
    live = part_like(policy, part)

    def blend(old: Any, current: Any) -> Any:
        if eqx.is_inexact_array(old):
            return decay * old + (1.0 - decay) * current
        return old

    return jax.tree.map(blend, part, live)


def reference_part(policy: Any, trainable: TrainableFilter | None = None) -> PyTree[Any]:
    """What a frozen KL reference keeps of `policy`: its trainable arrays that are not LoRA
    adapters (the adapters are switched off in the reference).

    **Arguments:**

    - `policy`: the initial policy.
    - `trainable`: the filter; `default_trainable(policy)` when `None`.

    **Returns:**

    A part of `policy` (no arrays at all when only adapters train).
    """
    part = trainable_part(policy, trainable)
    return eqx.filter(part, lora.adapter_filter(policy), inverse=True)


def held_part(part: PyTree[Any] | None, field: str, needed_by: str) -> PyTree[Any]:
    """`part`, a field of an objective's variables that a setting needs.

    **Arguments:**

    - `part`: the field's value (an EMA, a frozen reference, an old policy), or `None`.
    - `field`: the field's name, for the error.
    - `needed_by`: the setting that needs it and what for, for the error.

    **Returns:**

    `part`.

    **Raises:**

    - `ValueError`: naming `variables.<field>` and `needed_by`, when `part` is `None`.
    """
    if part is None:
        raise ValueError(
            f"`variables.{field}` is None, but {needed_by}: build the variables with `init`."
        )
    return part


def reference_policy(policy: _Model, part: PyTree[Any]) -> _Model:
    """The KL reference: `policy` carrying the frozen `part` (from `reference_part`), with
    its LoRA adapters switched off.

    **Arguments:**

    - `policy`: the live policy.
    - `part`: the frozen reference part.

    **Returns:**

    The reference model (the base model of a LoRA policy whose adapters alone train; the
    frozen initial policy of a fully trained one).
    """
    return lora.without_adapters(with_part(policy, part))
