"""How a model holds its blocks and runs them: one module per block, or stacked and scanned.

A model keeps its blocks in a tuple field and an `AbstractBlockLayout` beside it. The layout
says what the tuple holds (`UnstackedLayout`: one module per block; `StackedLayout`: one
module per group of blocks of one structure, its arrays with a leading block axis) and runs
the blocks in order. A layout holds no array, so the model's leaves and their tree paths
(`.blocks[i]...`) are those of the tuple alone.
"""

import abc
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias, TypeVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._distributed import gather_weights
from .._misc import check_bool
from ._attention_settings import AttentionSettings
from ._layers import QKV, WEIGHT_PRODUCT, AbstractAttention
from ._sequence_strategy import SequenceStrategy
from ._splash import ATTENTION_RESIDUALS


class AbstractRemat(eqx.Module):
    """A rematerialisation policy: what each block saves for the backward pass (the rest is
    recomputed there). It changes memory and speed, never what the model computes.

    The policies: `SaveNothing`, `SaveQKV`, `SaveAttention`, `SaveDots`; a model's `remat`
    `None` rematerialises nothing (whatever XLA keeps). Settings files and command lines name
    them (`"nothing"`, `"qkv"`, `"attention"`, `"dots"`, `"none"`: `remat_from_name`).
    `docs/accelerators.md` gives each one's memory and speed for SD3.5-Medium on a TPU.
    """

    @property
    @abc.abstractmethod
    def policy(self) -> Any:
        """The `jax.checkpoint` policy of a block's step (`jax.checkpoint_policies`)."""


@final
class SaveNothing(AbstractRemat):
    """Saves nothing inside the block: the whole block is recomputed. Settings name it
    `"nothing"`."""

    @property
    def policy(self) -> Any:
        return jax.checkpoint_policies.nothing_saveable


@final
class SaveQKV(AbstractRemat):
    """Saves every attention's queries, keys and values (after their projections and norms,
    named `QKV`). Settings name it `"qkv"`."""

    @property
    def policy(self) -> Any:
        return jax.checkpoint_policies.save_only_these_names(QKV)


@final
class SaveAttention(AbstractRemat):
    """Saves the queries, keys and values and each attention's result (with
    `SplashAttention` also its softmax statistics, `ATTENTION_RESIDUALS`), so the backward
    pass recomputes the token-wise layers but no attention. Settings name it `"attention"`."""

    @property
    def policy(self) -> Any:
        return jax.checkpoint_policies.save_only_these_names(QKV, ATTENTION_RESIDUALS)


@final
class SaveDots(AbstractRemat):
    """Saves the output of every matmul with a weight (named `WEIGHT_PRODUCT`); attention's
    scores and weighted sums, and the query-key norm's own products, are recomputed.
    Settings name it `"dots"`."""

    @property
    def policy(self) -> Any:
        # By name, not by JAX's `dots_with_no_batch_dims_saveable`: that also keeps the
        # query-key norm's block-diagonal products, `[S, width]` in float32 each, which took
        # SD3.5-Medium's LoRA step at batch 8 over a TPU v5e's memory.
        return jax.checkpoint_policies.save_only_these_names(WEIGHT_PRODUCT)


Remat: TypeAlias = AbstractRemat | None
"""One block's rematerialisation: an `AbstractRemat` policy (`SaveNothing()`, `SaveQKV()`,
`SaveAttention()`, `SaveDots()`), or `None` for none (whatever XLA keeps)."""

REMAT_NAMES: tuple[str, ...] = ("nothing", "qkv", "attention", "dots", "none")
"""The names settings files and command lines give the policies (`remat_from_name`)."""


def remat_from_name(name: str) -> Remat:
    """The rematerialisation policy a settings file or command line names.

    **Arguments:**

    - `name`: `"nothing"` (`SaveNothing`), `"qkv"` (`SaveQKV`), `"attention"`
        (`SaveAttention`), `"dots"` (`SaveDots`) or `"none"` (no rematerialisation).

    **Returns:**

    The policy, or `None` for `"none"`.

    **Raises:**

    - `ValueError`: naming `remat` when `name` is none of those.
    """
    policies: dict[str, Remat] = {
        "nothing": SaveNothing(),
        "qkv": SaveQKV(),
        "attention": SaveAttention(),
        "dots": SaveDots(),
        "none": None,
    }
    if name not in policies:
        raise ValueError(f"`remat` must be one of {REMAT_NAMES}, got {name!r}.")
    return policies[name]


BlockRemat: TypeAlias = Remat | tuple[Remat, ...]
"""A model's `remat`: one `Remat` for every block, or a tuple with one `Remat` per block, in
order. A tuple spends memory where one policy for every block cannot: on one TPU v5e,
SD3.5-Medium's full-gradient step at batch 8 saves the products (`SaveDots()`) of 12 of its
24 blocks and recomputes the rest (`SaveNothing()`) 7.5% faster than `SaveNothing()` for all,
while `SaveDots()` for all does not fit; 10 or 14 blocks are slower than 12
(`docs/accelerators.md`). Stacked, the blocks are held in runs of one structure and one
`Remat`, one scan each."""

_Block = TypeVar("_Block")
_Carry = TypeVar("_Carry")
_Step: TypeAlias = Callable[[_Block, _Carry], _Carry]
_Steps: TypeAlias = Callable[[Remat], _Step[_Block, _Carry]]
"""The step of one block under a given `Remat`."""
_Model = TypeVar("_Model", bound="AbstractLayeredModel")
_AttentionModel = TypeVar("_AttentionModel", bound="AbstractAttentionModel")


def _is_remat(remat: Any) -> bool:
    return remat is None or isinstance(remat, AbstractRemat)


def check_remat(remat: Any, depth: int | None = None) -> None:
    """Raise a `ValueError` naming `remat` unless it is a `BlockRemat` (an `AbstractRemat` or
    `None`, or a tuple of them, `depth` long when `depth` is given)."""
    if isinstance(remat, tuple):
        if not remat or not all(_is_remat(policy) for policy in remat):
            raise ValueError(
                "`remat` must be an AbstractRemat (SaveNothing(), SaveQKV(), SaveAttention(), "
                f"SaveDots()) or None, or a non-empty tuple of them (one per block), got "
                f"{remat!r}."
            )
        if depth is not None and len(remat) != depth:
            raise ValueError(
                f"`remat` must hold one policy per block ({depth}), got {len(remat)}: {remat!r}."
            )
    elif not _is_remat(remat):
        raise ValueError(
            "`remat` must be an AbstractRemat (SaveNothing(), SaveQKV(), SaveAttention(), "
            f"SaveDots()) or None, or a tuple of them (one per block), got {remat!r}; "
            "`remat_from_name` reads a setting's name."
        )


def block_remats(remat: BlockRemat, depth: int) -> tuple[Remat, ...]:
    """The `Remat` of each of `depth` blocks.

    **Arguments:**

    - `remat`: one policy for every block, or one per block.
    - `depth`: the number of blocks.

    **Returns:**

    A tuple of `depth` policies.

    **Raises:**

    - `ValueError`: naming `remat` when it is not a `BlockRemat` of `depth` blocks.
    """
    check_remat(remat, depth)
    if isinstance(remat, tuple):
        return remat
    return (remat,) * depth


def runs_of_one_remat(
    groups: tuple[tuple[int, int], ...], remat: BlockRemat
) -> tuple[tuple[int, int], ...]:
    """`groups` split wherever the blocks' `Remat` changes: the `[start, stop)` runs a
    `StackedLayout` holds and scans, each of one structure and one policy.

    **Arguments:**

    - `groups`: consecutive `[start, stop)` runs of blocks of one structure.
    - `remat`: one policy for every block, or one per block.

    **Returns:**

    The runs, consecutive from 0; `groups` itself when `remat` is one policy.

    **Raises:**

    - `ValueError`: naming `remat` when it is a tuple whose length is not the depth.
    """
    remats = block_remats(remat, groups[-1][1])
    runs = []
    for start, stop in groups:
        run_start = start
        for index in range(start + 1, stop):
            if remats[index] != remats[index - 1]:
                runs.append((run_start, index))
                run_start = index
        runs.append((run_start, stop))
    return tuple(runs)


def _stack_leaves(*leaves: Any) -> Any:
    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.stack(leaves)
    if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        shape = (len(leaves), *leaves[0].shape)
        return jax.ShapeDtypeStruct(shape, leaves[0].dtype)  # type: ignore[no-untyped-call]
    return jnp.stack(leaves)


def _index_leaf(leaf: Any, index: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)  # type: ignore[no-untyped-call]
    return leaf[index]


def stack_blocks(blocks: Sequence[_Block]) -> _Block:
    """Blocks of one structure as one block whose every array has a leading block axis.

    NumPy leaves stay NumPy (so a checkpoint can be stacked on the host), abstract ones
    (`jax.ShapeDtypeStruct`) stay abstract.
    """
    stacked: _Block = jax.tree.map(_stack_leaves, *blocks)
    return stacked


def unstack_block(group: _Block) -> list[_Block]:
    """The blocks of a stacked group, in order (the inverse of `stack_blocks`)."""
    size = jax.tree.leaves(group)[0].shape[0]
    return [jax.tree.map(lambda leaf, i=i: _index_leaf(leaf, i), group) for i in range(size)]


class AbstractBlockLayout(eqx.Module):
    """How a model holds its blocks (`hold`, `every_block`) and runs them in order (`run`).

    The layout changes how the blocks are held and compiled, never what they compute.
    """

    remat: eqx.AbstractVar[BlockRemat]

    @abc.abstractmethod
    def hold(self, blocks: Sequence[_Block]) -> tuple[_Block, ...]:
        """The held form of the blocks, given one module per block, in order.

        **Arguments:**

        - `blocks`: every block, in order.

        **Returns:**

        What the model's block tuple holds in this layout.

        **Raises:**

        - `ValueError`: naming `blocks` when their number does not fit the layout.
        """

    @abc.abstractmethod
    def every_block(self, held: Sequence[_Block]) -> tuple[_Block, ...]:
        """One module per block, in order (the inverse of `hold`).

        **Arguments:**

        - `held`: the blocks as this layout holds them.

        **Returns:**

        Every block (slices of the stacked arrays when stacked).
        """

    @abc.abstractmethod
    def _fold(self, held: Sequence[_Block], steps: _Steps[_Block, _Carry], carry: _Carry) -> _Carry:
        """`steps(policy)` over the held blocks in order, each block with its policy,
        threading `carry`."""

    def run(
        self,
        held: Sequence[_Block],
        step: Callable[[_Block, _Carry], _Carry],
        carry: _Carry,
    ) -> _Carry:
        """Every block in turn, each block's weights gathered whole, rematerialised per its
        `remat`.

        Inside a step on a data mesh (`jax.set_mesh`), `gather_weights` gathers each block's
        weights as the loop reaches it (the FSDP pattern: only weights travel, the
        activations stay split); elsewhere it changes nothing.

        **Arguments:**

        - `held`: the blocks as this layout holds them.
        - `step`: `(block, carry) -> carry`, one block applied.
        - `carry`: the activations before the first block.

        **Returns:**

        The activations after the last block.
        """

        def gathered(block: _Block, carry: _Carry) -> _Carry:
            return step(gather_weights(block), carry)

        def steps(remat: Remat) -> _Step[_Block, _Carry]:
            if remat is None:
                return gathered
            return jax.checkpoint(gathered, policy=remat.policy)

        return self._fold(held, steps, carry)


@final
class UnstackedLayout(AbstractBlockLayout):
    """One module per block, run in a Python loop (the program grows with the depth).

    **Arguments:**

    - `remat`: what each block keeps for the backward pass (`BlockRemat`).

    **Raises:**

    - `ValueError`: naming `remat` when it is not a `BlockRemat` (and, when the blocks are
        held, when a tuple's length is not their number).
    """

    remat: BlockRemat = eqx.field(static=True)

    def __check_init__(self) -> None:
        check_remat(self.remat)

    def hold(self, blocks: Sequence[_Block]) -> tuple[_Block, ...]:
        check_remat(self.remat, len(blocks))
        return tuple(blocks)

    def every_block(self, held: Sequence[_Block]) -> tuple[_Block, ...]:
        return tuple(held)

    def _fold(self, held: Sequence[_Block], steps: _Steps[_Block, _Carry], carry: _Carry) -> _Carry:
        for block, remat in zip(held, block_remats(self.remat, len(held)), strict=True):
            carry = steps(remat)(block, carry)
        return carry


@final
class StackedLayout(AbstractBlockLayout):
    """One module per run of consecutive blocks of one structure and one `Remat`, scanned
    with `lax.scan`.

    Each run's arrays have a leading block axis, so the compiled program and its compile
    time do not grow with the depth. With one `Remat` for every block the runs are `groups`.

    **Arguments:**

    - `groups`: the `[start, stop)` indices of each group of blocks of one structure,
        consecutive from 0.
    - `remat`: what each block keeps for the backward pass (`BlockRemat`).

    **Raises:**

    - `ValueError`: naming `groups` when the groups are empty or not consecutive non-empty
        runs from 0, or `remat` when it is not a `BlockRemat` of the groups' depth.
    """

    groups: tuple[tuple[int, int], ...] = eqx.field(static=True)
    remat: BlockRemat = eqx.field(static=True)

    def __check_init__(self) -> None:
        stops = [0] + [stop for _, stop in self.groups]
        starts = [start for start, _ in self.groups]
        if not self.groups or starts != stops[:-1] or any(a >= b for a, b in self.groups):
            raise ValueError(
                f"`groups` must be consecutive non-empty [start, stop) runs from 0, "
                f"got {self.groups!r}."
            )
        check_remat(self.remat, self.groups[-1][1])

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The `[start, stop)` runs held stacked: `groups` split where the `Remat` changes."""
        return runs_of_one_remat(self.groups, self.remat)

    def hold(self, blocks: Sequence[_Block]) -> tuple[_Block, ...]:
        depth = self.groups[-1][1]
        if len(blocks) != depth:
            raise ValueError(f"`blocks` must be {depth} blocks, got {len(blocks)}.")
        return tuple(stack_blocks(blocks[start:stop]) for start, stop in self.runs)

    def every_block(self, held: Sequence[_Block]) -> tuple[_Block, ...]:
        return tuple(block for group in held for block in unstack_block(group))

    def _fold(self, held: Sequence[_Block], steps: _Steps[_Block, _Carry], carry: _Carry) -> _Carry:
        remats = block_remats(self.remat, self.groups[-1][1])
        for group, (start, _) in zip(held, self.runs, strict=True):
            step = steps(remats[start])

            def body(carry: _Carry, block: _Block, step: Any = step) -> tuple[_Carry, None]:
                return step(block, carry), None

            carry, _ = jax.lax.scan(body, carry, group)
        return carry


def block_layout(
    stacked: Any, remat: Any, groups: tuple[tuple[int, int], ...]
) -> AbstractBlockLayout:
    """The layout of a model's `stacked` and `remat` arguments.

    **Arguments:**

    - `stacked`: whether the blocks are stacked per group.
    - `remat`: what each block keeps for the backward pass (`BlockRemat`).
    - `groups`: the `[start, stop)` runs of blocks of one structure.

    **Returns:**

    A `StackedLayout` of `groups` or an `UnstackedLayout`.

    **Raises:**

    - `ValueError`: naming `stacked` when it is not a bool, or `remat` when it is not a
        `BlockRemat` of the groups' depth.
    """
    check_bool("stacked", stacked)
    check_remat(remat, groups[-1][1] if groups else None)
    if stacked:
        return StackedLayout(groups=groups, remat=remat)
    return UnstackedLayout(remat=remat)


def relayout(
    held: tuple[_Block, ...], layout: AbstractBlockLayout, new: AbstractBlockLayout
) -> tuple[_Block, ...]:
    """The blocks held in `layout` as `new` holds them (the same tuple when they agree).

    **Arguments:**

    - `held`: the blocks as `layout` holds them.
    - `layout`: their layout.
    - `new`: the layout wanted.

    **Returns:**

    The blocks in `new`'s form; restacking copies the arrays.
    """
    same_form = type(layout) is type(new) and (
        not isinstance(new, StackedLayout)
        or (isinstance(layout, StackedLayout) and layout.runs == new.runs)
    )
    if same_form:
        return held
    return new.hold(layout.every_block(held))


class AbstractLayeredModel(eqx.Module):
    """A model whose blocks an `AbstractBlockLayout` holds and runs (`DiT`, `MMDiT`).

    Concrete models give the two fields; the layout's settings read back through `stacked`
    and `remat`, and `relaid` changes them.
    """

    blocks: eqx.AbstractVar[tuple[Any, ...]]
    block_layout: eqx.AbstractVar[AbstractBlockLayout]

    @property
    def stacked(self) -> bool:
        """Whether the blocks are held stacked per group and scanned over."""
        return isinstance(self.block_layout, StackedLayout)

    @property
    def remat(self) -> BlockRemat:
        """What each block keeps for the backward pass (`BlockRemat`)."""
        return self.block_layout.remat

    def relaid(
        self: _Model,
        stacked: bool | None,
        remat: BlockRemat | Literal["keep"],
        groups: tuple[tuple[int, int], ...],
    ) -> _Model:
        """The same model with its blocks in another layout.

        **Arguments:**

        - `stacked`: the block layout; `None` keeps it.
        - `remat`: the rematerialisation policy (`BlockRemat`); `"keep"` keeps it.
        - `groups`: the `[start, stop)` runs of blocks of one structure.

        **Returns:**

        A new model of the same type; restacking copies the blocks' arrays.

        **Raises:**

        - `ValueError`: as `block_layout`.
        """
        layout = block_layout(
            self.stacked if stacked is None else stacked,
            self.remat if remat == "keep" else remat,
            groups,
        )
        blocks = relayout(self.blocks, self.block_layout, layout)
        new: _Model = eqx.tree_at(lambda m: (m.blocks, m.block_layout), self, (blocks, layout))
        return new

    def _outer_weights(self: _Model) -> _Model:
        """The model without its blocks (`blocks` empty), its other weights gathered whole on
        a data mesh (`gather_weights`): what a call uses outside the blocks, which
        `block_layout.run` gathers one at a time."""
        outer: _Model = gather_weights(eqx.tree_at(lambda m: m.blocks, self, ()))
        return outer


class AbstractAttentionModel(AbstractLayeredModel):
    """A layered transformer whose attention an `AttentionSettings` chooses (`MMDiT`, `Flux`).

    Concrete models give `attention_settings` and `block_groups` (the `[start, stop)` runs of
    blocks of one structure); `with_settings` changes the layout and the attention on a
    built model without changing what it computes.
    """

    attention_settings: eqx.AbstractVar[AttentionSettings]

    @property
    @abc.abstractmethod
    def block_groups(self) -> tuple[tuple[int, int], ...]:
        """The `[start, stop)` block indices of each group of one structure."""

    @property
    def attention(self) -> AbstractAttention:
        """How attention is computed (`AbstractAttention`)."""
        return self.attention_settings.attention

    @property
    def sequence_strategy(self) -> SequenceStrategy:
        """How attention runs over tokens split by a mesh's sequence axis."""
        return self.attention_settings.sequence

    def unstacked_blocks(self) -> tuple[Any, ...]:
        """Every block as its own module, in order, whatever the layout.

        **Returns:**

        A tuple with one module per block (views of the stacked arrays' slices when
        `stacked`).
        """
        return self.block_layout.every_block(self.blocks)

    def with_settings(
        self: _AttentionModel,
        *,
        stacked: bool | None = None,
        remat: BlockRemat | Literal["keep"] = "keep",
        attention: AbstractAttention | None = None,
        sequence_strategy: SequenceStrategy | None = None,
    ) -> _AttentionModel:
        """The same model (the same function of the same weights) with other settings.

        **Arguments:**

        - `stacked`: the block layout; `None` keeps it.
        - `remat`: the rematerialisation policy (`BlockRemat`); `"keep"` keeps it.
        - `attention`: how attention is computed (`AbstractAttention`); `None` keeps it.
        - `sequence_strategy`: how attention runs over tokens split by a sequence axis
            (`UlyssesSequence()`, `RingSequence()`); `None` keeps it.

        **Returns:**

        A new model of the same type; restacking copies the blocks' arrays.

        **Raises:**

        - `ValueError`: naming the setting, when it is not one of its values.
        """
        settings = AttentionSettings(
            self.attention if attention is None else attention,
            self.sequence_strategy if sequence_strategy is None else sequence_strategy,
        )
        relaid = self.relaid(stacked, remat, self.block_groups)
        new: _AttentionModel = eqx.tree_at(lambda m: m.attention_settings, relaid, settings)
        return new
