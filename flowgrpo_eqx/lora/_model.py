"""The adapter model: `LoraAdapter`, `LoraModel`, and `merge`, what calling one computes."""

from collections.abc import Callable
from typing import Any, Generic, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._misc import check_int, check_number


ModelT = TypeVar("ModelT", bound=Callable[..., Any])
"""The type of the base model an adapted model wraps and gives back."""


@final
class LoraAdapter(eqx.Module):
    """The low-rank update `b @ a` of one `eqx.nn.Linear` weight `[out, in]`.

    A layer of stacked blocks (weight `[layers, out, in]`) has one update per layer, with the
    same leading axes: `a` `[layers, rank, in]`, `b` `[layers, out, rank]`.

    **Arguments:**

    - `a`: `[rank, in]`.
    - `b`: `[out, rank]`.
    """

    a: Float[Array, "*layers rank in"]
    b: Float[Array, "*layers out rank"]


@final
class LoraModel(eqx.Module, Generic[ModelT]):
    """A base model with low-rank adapters on some of its `eqx.nn.Linear` layers.

    Built by `add` (or `load_adapters`). Called with any arguments, it calls `merge(self)`
    with them: the base model whose selected layers hold `W + (alpha / rank) b @ a`.

    **Arguments:**

    - `base`: the base model, left as it was.
    - `adapters`: one `LoraAdapter` per adapted layer, in the order of `layer_paths`.
    - `layer_paths`: where each adapted layer sits in `base`, as `jax.tree_util.keystr`
        writes its key path (e.g. `.blocks[0].qkv`).
    - `rank`: the rank of every adapter.
    - `alpha`: the adapters' scale numerator; the update is `(alpha / rank) b @ a`.

    **Raises:**

    - `ValueError`: naming `rank`, `alpha` or `adapters` when they do not fit together.
    """

    base: ModelT
    adapters: tuple[LoraAdapter, ...]
    layer_paths: tuple[str, ...] = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)

    def __check_init__(self) -> None:
        check_int("rank", self.rank, 1)
        check_number("alpha", self.alpha, minimum=0, include_minimum=False)
        if len(self.adapters) != len(self.layer_paths):
            raise ValueError(
                f"`adapters` has {len(self.adapters)} entries for "
                f"{len(self.layer_paths)} layer paths."
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the base model, with the adapters folded into its weights.

        **Arguments:**

        Whatever the base model's `__call__` takes, e.g. `(x, t, cond)`.

        **Returns:**

        What the base model returns.
        """
        return merge(self)(*args, **kwargs)


def is_linear(node: Any) -> bool:
    return isinstance(node, eqx.nn.Linear)


def require_lora_model(model: Any, name: str) -> None:
    if not isinstance(model, LoraModel):
        raise ValueError(
            f"`{name}` must be a `LoraModel` (see `lora.add`), got {type(model).__name__}."
        )


def merge(model: LoraModel[ModelT]) -> ModelT:
    """The base model with the adapters folded into its weights.

    Each adapted layer's weight becomes `W + (alpha / rank) b @ a` (the product `b @ a` at
    full float32 precision, the sum in the wider of `W`'s and the adapters' dtypes), cast to
    the dtype of `W`. The result has the structure of the
    base model: it serialises into it and needs nothing from this module to run.

    **Arguments:**

    - `model`: a `LoraModel`.

    **Returns:**

    A plain model of the base model's type.

    **Raises:**

    - `ValueError`: naming `model` when it is not a `LoraModel`.
    """
    require_lora_model(model, "model")
    by_path = dict(zip(model.layer_paths, model.adapters, strict=True))
    scale = model.alpha / model.rank

    def fold(path: tuple[Any, ...], node: Any) -> Any:
        adapter = by_path.get(jax.tree_util.keystr(path)) if is_linear(node) else None
        if adapter is None:
            return node
        weight = node.weight
        update = jnp.matmul(adapter.b, adapter.a, precision=jax.lax.Precision.HIGHEST)
        wider = max(weight.dtype, update.dtype, key=lambda dtype: jnp.dtype(dtype).itemsize)
        merged = weight.astype(wider) + scale * update.astype(wider)
        return eqx.tree_at(lambda layer: layer.weight, node, merged.astype(weight.dtype))

    merged: ModelT = jax.tree_util.tree_map_with_path(fold, model.base, is_leaf=is_linear)
    return merged
