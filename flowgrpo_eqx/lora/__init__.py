"""Low-rank adapters (LoRA) for any Equinox model built from `eqx.nn.Linear` layers.

`add(model, rank, key=...)` returns a `LoraModel`: the untouched base model plus one
`LoraAdapter` (`a: [rank, in]`, `b: [out, rank]`) per selected `eqx.nn.Linear`. Calling it
calls the base model with each selected layer's weight replaced by
`W + (alpha / rank) b @ a`, so the base model runs its own code unchanged, whether it calls
its layers or reads their `weight` directly. `b` starts at zero, so a fresh `LoraModel`
computes exactly what the base model computes.

Train only the adapters with `adapter_filter(model)` as the trainable filter (the library's
`Trainer` does so by default for a policy with adapters); `base(model)` is the frozen base
(the adapters switched off, the KL reference), `merge(model)` a plain model with the adapters
folded in. `without_bases`/`with_bases` leave the frozen base out of checkpoints and put it
back; `save_adapters`/`load_adapters` write and read the adapters alone, with the base
model's `fingerprint`.
"""

from ._file import (
    fingerprint as fingerprint,
    load_adapters as load_adapters,
    save_adapters as save_adapters,
)
from ._model import LoraAdapter as LoraAdapter, LoraModel as LoraModel, merge as merge
from ._tree import (
    adapter_filter as adapter_filter,
    adapters as adapters,
    add as add,
    base as base,
    has_adapters as has_adapters,
    with_adapters as with_adapters,
    with_bases as with_bases,
    without_adapters as without_adapters,
    without_bases as without_bases,
)
