"""A generic trainer for any `AbstractFlowObjective` (its `init`, `loss` and
`loss_sums_over_rows`).

The optimizer step is one jit-compiled function of an immutable `TrainState`; everything
random is derived from keys held in that state, so a run resumed from a checkpoint repeats
an uninterrupted one exactly.
"""

import contextlib
import types
from collections.abc import Sequence
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._custom_types import Mean, Model, Step
from .._distributed import mesh_of
from .._misc import check_bool, check_int, check_number, leading_rows, own_copy
from ..objectives import (
    AbstractFlowObjective,
    AbstractVariables,
    Rescore,
    TrainableFilter,
    default_trainable,
    split_trainable,
)
from ..objectives._base import BatchT
from ._batch_checks import check_advantages, finite_advantages
from ._microbatches import combine_microbatches, is_mean_or_per_row, mean_values, split_microbatches


@final
class TrainState(eqx.Module):
    """Everything that changes during training.

    **Arguments:**

    - `variables`: the objective's variables (the live policy and whatever else it reads).
    - `opt_state`: the optax state of the trainable parameters.
    - `step`: the number of optimizer updates so far.
    - `key`: the PRNG key the next update derives its randomness from (raw uint32 key data,
        so it serialises with the rest).
    - `ema`: with `Trainer(ema_decay=...)`, the exponential moving average of the policy's
        trainable part (`Trainer.split_policy`: the adapters of a LoRA policy by default, or
        whatever the trainer's filter selects); else `None`. `with_part(policy, ema)` is the
        averaged policy.
    """

    variables: AbstractVariables
    opt_state: PyTree[Any]
    step: Int[Array, ""]
    key: PRNGKeyArray
    ema: PyTree[Any] | None = None


def default_optimizer(
    learning_rate: float = 1e-4,
    weight_decay: float = 1e-4,
    max_grad_norm: float | None = 1.0,
    decay_steps: int | None = None,
) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping, as the reference Flow-GRPO trainer.

    **Arguments:**

    - `learning_rate`: the AdamW step size.
    - `weight_decay`: the decoupled weight decay.
    - `max_grad_norm`: the global-norm clip, or `None` for none.
    - `decay_steps`: `None` for a constant step size, or the number of updates over which it
        follows a cosine from `learning_rate` down to 0 (and stays at 0 after).

    **Returns:**

    An `optax.GradientTransformation`.

    **Raises:**

    - `ValueError`: naming the argument, for a learning rate, clip or `decay_steps` that is
        not a finite positive number (an int for `decay_steps`), or a negative weight decay.
    """
    check_number("learning_rate", learning_rate, minimum=0, include_minimum=False)
    check_number("weight_decay", weight_decay, minimum=0)
    check_number("max_grad_norm", max_grad_norm, minimum=0, include_minimum=False, optional=True)
    check_int("decay_steps", decay_steps, 1, optional=True)
    step_size: float | optax.Schedule = (
        learning_rate
        if decay_steps is None
        else optax.cosine_decay_schedule(learning_rate, decay_steps)
    )
    adamw = optax.adamw(step_size, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


@final
class Trainer(eqx.Module):
    """Optimise an objective's live policy with optax; the rest of its variables is its own.

    **Arguments:**

    - `objective`: any `AbstractFlowObjective` (`FlowGRPOObjective`,
        `DiffusionNFTObjective`, `FlowMatchingObjective`).
    - `optimizer`: an optax transformation; `default_optimizer()` (AdamW, clip 1.0) if `None`.
    - `trainable`: an Equinox filter choosing the trained parameters of the policy: a
        callable on leaves or a PyTree of bools shaped like the policy. Everything else stays
        frozen. `None` (the default) trains the LoRA adapters of a policy that has them
        (`lora.adapter_filter(policy)`: the base weights stay frozen and the optimizer state
        holds adapter-shaped arrays only), and every float array of any other policy
        (`eqx.is_inexact_array`). The trainer splits the policy by it once
        (`split_policy`); the optimizer state, the EMA and the objective's copies (an old
        policy, the frozen KL reference) all hold that trainable part, so a filter that
        trains a LoRA policy's adapters and base weights together keeps both in each.
    - `ema_decay`: the decay of an exponential moving average of the policy's trainable
        part kept in `TrainState.ema`, updated after every `ema_every`-th optimizer step;
        `None` (the default) keeps none.
    - `ema_every`: optimizer steps between EMA updates: the average moves after step `s`
        (counted from 1) when `ema_every` divides `s`. 1 (the default) updates every step.
    - `ema_warmup`: whether the decay of the update after step `s` is
        `min((1 + s') / (10 + s'), ema_decay)` with `s' = s - 1` the steps before it (the
        decay flow_grpo's `EMAModuleWrapper` gives, so early averages follow the weights
        closely), rather than `ema_decay` throughout (the default).
    - `microbatches`: how many microbatches of rows one update accumulates gradients over
        (one optimizer step), so that the rows a device holds are not bounded by activation
        memory. The loss is a `Mean(total, count)`: the update sums the microbatches'
        totals, counts and gradients of the totals, and divides once, so it is the whole
        batch's mean and gradient (equal in exact arithmetic; to float rounding here).
        Microbatch `m` holds rows `m, m + M, m + 2M, ...`, so with rows split over a data
        mesh each device keeps its own rows in every microbatch (the rows per device must
        then be a multiple of `microbatches`). The auxiliary output is combined the same way:
        `Mean`s summed as totals and counts, per-row arrays put back in row order, other
        arrays summed. Every microbatch sees the same `Step` (index and key). 1 (the
        default) evaluates the batch at once.

    **Raises:**

    - `ValueError`: naming `optimizer` if it is not an `optax.GradientTransformation` (say,
        the string `"adam"`); for an `ema_decay` outside [0, 1), or `microbatches` not an int
        >= 1, or `microbatches > 1` with an objective whose loss is not a sum of per-row parts
        (`objective.loss_sums_over_rows()` false, as with GRPO-Guard's `guard`, which
        normalises the ratio with whole-minibatch statistics).
    """

    objective: AbstractFlowObjective[Any]
    optimizer: optax.GradientTransformation = eqx.field(static=True)
    trainable: TrainableFilter | None = eqx.field(static=True)
    ema_decay: float | None
    microbatches: int = eqx.field(static=True)
    ema_every: int = eqx.field(static=True)
    ema_warmup: bool = eqx.field(static=True)

    def __init__(
        self,
        objective: AbstractFlowObjective[Any],
        optimizer: optax.GradientTransformation | None = None,
        *,
        trainable: TrainableFilter | None = None,
        ema_decay: float | None = None,
        microbatches: int = 1,
        ema_every: int = 1,
        ema_warmup: bool = False,
    ):
        self.objective = objective
        self.optimizer = default_optimizer() if optimizer is None else optimizer
        self.trainable = trainable
        self.ema_decay = ema_decay
        self.microbatches = microbatches
        self.ema_every = ema_every
        self.ema_warmup = ema_warmup

    def __check_init__(self) -> None:
        if not isinstance(self.optimizer, optax.GradientTransformation):
            raise ValueError(
                "`optimizer` must be an optax.GradientTransformation (e.g. optax.adamw(1e-4) or "
                f"default_optimizer()), got {type(self.optimizer).__name__} {self.optimizer!r}."
            )
        check_number(
            "ema_decay", self.ema_decay, minimum=0, maximum=1, include_maximum=False, optional=True
        )
        check_int("microbatches", self.microbatches, 1)
        check_int("ema_every", self.ema_every, 1)
        check_bool("ema_warmup", self.ema_warmup)
        if self.microbatches > 1 and not self.objective.loss_sums_over_rows():
            raise ValueError(
                f"`microbatches` ({self.microbatches}) must be 1 with "
                f"{type(self.objective).__name__} as configured: its loss is not a sum of "
                "per-row parts (`loss_sums_over_rows()` is false: say, GRPO-Guard's "
                "whole-minibatch statistics, or DGPO's rows weighted by their group)."
            )

    def trainable_filter(self, policy: Model) -> TrainableFilter:
        """The filter in use for `policy`: `trainable`, or its default when `None`.

        **Arguments:**

        - `policy`: the live policy.

        **Returns:**

        `trainable` when given; else `default_trainable(policy)`: the adapters of a policy
        with LoRA adapters, every float array of any other.
        """
        return default_trainable(policy) if self.trainable is None else self.trainable

    def split_policy(self, policy: Model) -> tuple[PyTree[Any], PyTree[Any]]:
        """`(trainable, frozen)` parts of the policy, by `trainable_filter(policy)`.

        The trainable part holds the floating-point arrays the filter selects; everything
        else, including whatever non-array leaves (activations, static settings) the filter
        selects and every array inside a `Buffer`, stays in the frozen part, so `eqx.combine`
        of the two is the whole policy.

        **Arguments:**

        - `policy`: the live policy.

        **Returns:**

        `(trainable, frozen)`, two PyTrees shaped like `policy` with `None` where the other
        one has the leaf.
        """
        return split_trainable(policy, self.trainable_filter(policy))

    def init(self, key: PRNGKeyArray, variables: AbstractVariables | None = None) -> TrainState:
        """The initial state: the objective's variables and a fresh optimizer state.

        **Arguments:**

        - `key`: seeds all of training's randomness.
        - `variables`: start from these instead of `objective.init`.

        **Raises:**

        - `ValueError`: naming `trainable` when its filter (or the default one) selects no
            floating-point array of the policy (nothing would train), before any other work;
            naming `variables` when its policy is not of the structure of the objective's
            initial policy (say, one has LoRA adapters and the other none: the objective's
            variables would be built for another policy).

        **Returns:**

        A `TrainState` at step 0, holding its own copies of the variables' arrays (updates
        donate their buffers, so the objective's model is never consumed).
        """
        policy = variables.policy if variables is not None else self.objective.initial_policy()
        selected, _ = self.split_policy(policy)
        if not jax.tree.leaves(selected):
            if self.trainable is None:
                given = "the default filter"
            elif isinstance(self.trainable, types.FunctionType):
                given = f"the function {self.trainable.__qualname__}"
            else:
                given = f"a filter of type {type(self.trainable).__name__}"
            raise ValueError(
                f"`trainable` ({given}) selects no floating-point array of the policy "
                f"{type(policy).__name__}: every parameter would stay frozen and training "
                "would do nothing. Select at least one float array (e.g. eqx.is_inexact_array)."
            )
        init_key, train_key = jax.random.split(key)
        variables = self.objective.init(
            init_key, variables, trainable=self.trainable_filter(policy)
        )
        expected: Any = jax.tree.structure(self.objective.initial_policy())
        if jax.tree.structure(variables.policy) != expected:
            raise ValueError(
                "`variables.policy` must have the structure of the objective's initial policy "
                "(the same layers, and LoRA adapters on both or neither); build the objective "
                "with the model it trains."
            )
        variables = own_copy(variables)
        trainable, _ = self.split_policy(variables.policy)
        ema = None if self.ema_decay is None else own_copy(trainable)
        opt_state = self.optimizer.init(trainable)
        return TrainState(
            variables=variables,
            opt_state=opt_state,
            step=jnp.asarray(0, jnp.int32),
            key=train_key,
            ema=ema,
        )

    def update(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Array]]:
        """One optimizer update on `batch`, returning the new state; `state` must not be used
        again once the update has run (a batch refused first leaves it usable).

        Jit-compiled; the old state's buffers are donated to the new one. The batch's
        advantages are checked on the host before that (a copy of a few floats per row;
        nothing runs on the device for it). When the state's arrays lie on a mesh
        (`shard_parameters`), the step is traced under it (`jax.set_mesh`), so that models
        gather each block's weights where they use them (`gather_weights`) and the rows
        stay split.

        **Arguments:**

        - `state`: the current state.
        - `batch`: whatever the objective's `loss` takes.

        **Returns:**

        The new state and `{name: scalar}` metrics: `loss`, `grad_norm`, `count` (the loss
        `Mean`'s count), and every auxiliary `Mean`'s value.

        **Raises:**

        - `ValueError`: as the objective's `loss`, raised while tracing the update (say,
            naming `batch` when it is not the batch type the objective trains on); naming
            `batch.advantages` when the batch has advantages and one of them is NaN or
            infinite (they would make every trained parameter NaN); naming `microbatches` when
            it does not divide the batch's rows. All before anything is donated: `state`
            stays usable (to retry with another batch, or to save).
        - `EquinoxRuntimeError` (from `eqx.error_if`): naming `batch.advantages`, for a
            non-finite advantage when `update` is itself traced (inside the caller's own
            `jax.jit`), where the values are not known until the program runs.
        """
        checked = check_advantages(batch)
        with _mesh_context(state):
            new_state, metrics, _ = _update_donating((self, batch, checked), state)
        return new_state, metrics

    def run_update(self, state: TrainState, batch: Any) -> Any:
        """The auxiliary output of the update program for `batch` at `state`.

        Runs the very program `update` runs (same compiled executable, on a copy of `state`,
        which is left as it was) and returns what the objective's `loss` gave besides its
        value, computed exactly as the update computes it.

        **Arguments:**

        - `state`: the state to evaluate at (not consumed).
        - `batch`: a minibatch shaped as the updates' minibatches.

        **Returns:**

        The `loss`'s auxiliary PyTree.

        **Raises:**

        - `ValueError`: as `update`.
        """
        checked = check_advantages(batch)
        with _mesh_context(state):
            _, _, aux = _update_donating((self, batch, checked), own_copy(state))
        return aux

    def rescore(
        self, state: TrainState, request: Rescore[BatchT], first_pass: Sequence[Int[Array, " M"]]
    ) -> BatchT:
        """The batch of a `Rescore` request, rescored by the update program at `state`.

        Each minibatch of the first pass of updates goes through `run_update` (the update
        program without its optimizer step) at the state that sampled the batch, and the
        request's `fill` writes what the loss reported back into those rows, so the first
        pass of updates sees exactly the numbers it computes itself, whatever the precision.

        **Arguments:**

        - `state`: the state that sampled the batch (not consumed).
        - `request`: the objective's `Rescore`.
        - `first_pass`: the rows of each minibatch of the first pass, in order.

        **Returns:**

        The rescored batch.
        """
        batch = request.batch
        for rows in first_pass:
            minibatch = jax.tree.map(lambda leaf, rows=rows: leaf[rows], batch)
            batch = request.fill(batch, rows, self.run_update(state, minibatch))
        return batch

    def _update(
        self, state: TrainState, batch: Any, advantages_checked: bool = False
    ) -> tuple[TrainState, dict[str, Array], Any]:
        """The update program's body; `advantages_checked` says whether `check_advantages`
        checked the batch's advantages on the host already (else they are checked here)."""
        if not advantages_checked:
            batch = finite_advantages(batch)
        key, step_key = jax.random.split(state.key)
        variables = state.variables
        trainable, frozen = self.split_policy(variables.policy)

        def objective_value(params: PyTree[Any]) -> tuple[Array, tuple[Mean, Any]]:
            policy = eqx.combine(params, frozen)
            total, aux = self.objective.loss(
                eqx.tree_at(lambda v: v.policy, variables, policy),
                batch,
                Step(index=state.step, key=step_key),
            )
            return total.value, (total, aux)

        if self.microbatches == 1:
            (value, (total, aux)), grads = eqx.filter_value_and_grad(objective_value, has_aux=True)(
                trainable
            )
        else:
            value, total, aux, grads = self._accumulate(state, trainable, frozen, batch, step_key)
        # optax mixes Python floats with its int32 step count (bias correction, schedules),
        # which strict dtype promotion rejects; only the optimizer's arithmetic is exempt.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = self.optimizer.update(grads, state.opt_state, trainable)
        trainable = eqx.apply_updates(trainable, updates)
        policy = eqx.combine(trainable, frozen)
        ema = state.ema
        if self.ema_decay is not None:
            decay = self._ema_decay(state.step)
            moves = (state.step + 1) % self.ema_every == 0

            def blend(average: Any, current: Any) -> Any:
                if eqx.is_inexact_array(average):
                    moved = decay * average + (1.0 - decay) * current
                    return jnp.where(moves, moved.astype(average.dtype), average)
                return average

            ema = jax.tree.map(blend, ema, trainable)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": value, "grad_norm": grad_norm, "count": total.count}
        metrics.update(mean_values(aux))
        new_state = TrainState(
            variables=eqx.tree_at(lambda v: v.policy, variables, policy),
            opt_state=opt_state,
            step=state.step + 1,
            key=key,
            ema=ema,
        )
        return new_state, metrics, aux

    def _ema_decay(self, done: Int[Array, ""]) -> Float[Array, ""] | float:
        """The decay of the EMA update after the step that follows `done` steps."""
        assert self.ema_decay is not None
        if not self.ema_warmup:
            return self.ema_decay
        steps = done.astype(jnp.float32)
        return jnp.minimum((1.0 + steps) / (10.0 + steps), self.ema_decay)

    def _accumulate(
        self,
        state: TrainState,
        trainable: PyTree[Any],
        frozen: PyTree[Any],
        batch: Any,
        step_key: PRNGKeyArray,
    ) -> tuple[Array, Mean, Any, PyTree[Any]]:
        """The loss, its `Mean`, the aux and the gradient of the mean, over microbatches."""
        rows = leading_rows(batch)
        pieces, static = split_microbatches(batch, rows, self.microbatches)
        variables = state.variables

        def total_of(params: PyTree[Any], piece: Any) -> tuple[Array, tuple[Mean, Any]]:
            policy = eqx.combine(params, frozen)
            total, aux = self.objective.loss(
                eqx.tree_at(lambda v: v.policy, variables, policy),
                eqx.combine(piece, static),
                Step(index=state.step, key=step_key),
            )
            return total.total, (total, aux)

        gradient = eqx.filter_value_and_grad(total_of, has_aux=True)

        def one(
            summed: tuple[PyTree[Any], Mean], piece: Any
        ) -> tuple[tuple[PyTree[Any], Mean], Any]:
            grads, total = summed
            (_, (piece_total, aux)), piece_grads = gradient(trainable, piece)
            grads = jax.tree.map(jnp.add, grads, piece_grads)
            return (grads, total + piece_total), aux

        zero_grads = jax.tree.map(jnp.zeros_like, trainable)
        first = jax.tree.map(lambda leaf: leaf[0], pieces)
        (_, (like, _)), _ = eqx.filter_eval_shape(gradient, trainable, first)
        zero = Mean(jnp.zeros((), like.total.dtype), jnp.zeros((), like.count.dtype))
        (grads, total), auxes = jax.lax.scan(one, (zero_grads, zero), pieces)

        aux = jax.tree.map(
            lambda leaf: combine_microbatches(leaf, rows), auxes, is_leaf=is_mean_or_per_row
        )
        count = total.count
        safe = jnp.where(count > 0, count, jnp.ones_like(count))
        grads = jax.tree.map(
            lambda g: jnp.where(count > 0, g / safe.astype(g.dtype), jnp.zeros_like(g)), grads
        )
        return total.value, total, aux, grads


def _mesh_context(state: TrainState) -> contextlib.AbstractContextManager[Any]:
    """The mesh of the state's sharded arrays as JAX's current mesh (`jax.set_mesh`), so that
    models can gather each block's weights inside the step (`gather_weights`); nothing for a
    state on one device."""
    mesh = mesh_of(state)
    if mesh is None:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[Any] = jax.set_mesh(mesh)
    return context


@eqx.filter_jit(donate="all-except-first")
def _update_donating(
    trainer_batch_checked: tuple[Trainer, Any, bool], state: TrainState
) -> tuple[TrainState, dict[str, Array], Any]:
    """The update program; `state` is donated to the new state, so everything that refuses
    the batch by its values (`check_advantages`) runs before it."""
    trainer, batch, advantages_checked = trainer_batch_checked
    return trainer._update(state, batch, advantages_checked)
