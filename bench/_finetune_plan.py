"""The memory plans of `flowgrpo-eqx finetune`'s two device programs at a published size,
compiled ahead of time for one TPU chip on any host with libtpu (no chip, nothing run): the
rollout call (sampling, decoding and the device rewards) and the update (`Trainer`'s step on
one update's rows). What a row's settings ask of the chip's memory, before device time is
spent on it (`python -m bench.finetune --row ROW --topology v5e`)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from flowgrpo_eqx import Transitions
from flowgrpo_eqx.finetune._config import FinetuneConfig
from flowgrpo_eqx.finetune._job import Job, rollout_program
from flowgrpo_eqx.finetune._pipeline import PIPELINE_KINDS, Pipeline, TextSide
from flowgrpo_eqx.finetune._plan import MeshPlan
from flowgrpo_eqx.finetune._rewards import DeviceTerm, _random_clip
from flowgrpo_eqx.models import attention_from_name, remat_from_name
from flowgrpo_eqx.rewards import PickScore

from ._full_size import plan_gib


TOPOLOGIES = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1"}


def _abstract(tree: Any, sharding: Any) -> Any:
    """Every array (or shape) of `tree` as a `ShapeDtypeStruct` placed by `sharding`."""

    def place(leaf: Any) -> Any:
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)  # type: ignore[no-untyped-call]
        return leaf

    return jax.tree.map(place, tree)


def _is_dynamic(leaf: Any) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def _compile(function: Any, arguments: Any, donate: tuple[int, ...] = ()) -> dict[str, Any]:
    """Compile `function(*arguments)` (its non-array leaves static) and return its plan, or
    the compiler's refusal."""
    dynamic, static = eqx.partition(arguments, _is_dynamic)

    def body(*parts: Any) -> Any:
        return function(*eqx.combine(parts, static))

    try:
        compiled = jax.jit(body, donate_argnums=donate).lower(*dynamic).compile()
    except Exception as error:  # noqa: BLE001 - a plan that does not fit is the result
        return {"error": " ".join(str(error).split())[:500]}
    return {"plan_gib": plan_gib(compiled.memory_analysis())}


def _abstract_pipeline(config: FinetuneConfig) -> Pipeline:
    kind = PIPELINE_KINDS[config.kind]
    transformer = eqx.filter_eval_shape(lambda: kind.transformer(None, config))
    transformer = transformer.with_settings(
        remat=remat_from_name(config.precision.remat),
        attention=attention_from_name(config.precision.attention),
    )
    return Pipeline(
        kind=config.kind,
        transformer=transformer,
        vae=eqx.filter_eval_shape(lambda: kind.vae(None, config)),
        process=kind.process(None, config),
        guidance=kind.guidance(config),
        latent_shape=kind.latent_shape(config),
        select=kind.select,
        text=TextSide(None),
        needs_null=kind.needs_null and kind.guidance(config) is not None,
    )


def _condition_shapes(config: FinetuneConfig, transformer: Any) -> dict[str, tuple[int, ...]]:
    length = config.prompts.text_length or 0
    if config.kind == "sd3":
        return {
            "context": (77 + length, transformer.context_dim),
            "pooled": (transformer.pooled_dim,),
        }
    if config.kind in ("flux-dev", "flux-schnell"):
        return {"context": (length, transformer.context_dim), "pooled": (transformer.pooled_dim,)}
    return {"context": (length, transformer.text_dim)}


def _transitions(job: Job, rows: dict[str, Any], count: int) -> Transitions:
    """The `Transitions` of `count` rows the update takes, as shapes: each row's recorded
    transitions (latents before and after, times, old log densities, mask), its advantage
    and its condition."""
    recorded = job.rollout.recorded_transitions
    latent = job.flow.inputs.latent_shape
    assert latent is not None

    def shape(*dims: int, dtype: Any = jnp.float32) -> Any:
        return jax.ShapeDtypeStruct(dims, dtype)  # type: ignore[no-untyped-call]

    cond = {k: shape(count, *v.shape[1:], dtype=v.dtype) for k, v in rows.items()}
    return Transitions(
        latents=shape(count, recorded, *latent),
        next_latents=shape(count, recorded, *latent),
        timesteps=shape(count, recorded),
        next_timesteps=shape(count, recorded),
        old_log_probs=shape(count, recorded),
        transition_mask=shape(count, recorded, dtype=jnp.bool_),
        advantages=shape(count),
        cond=cond,
    )


def plans(config: FinetuneConfig, topology: str) -> dict[str, Any]:
    """The rollout call's and the update's memory plans for one chip of `topology`.

    **Arguments:**

    - `config`: a resolved configuration of random weights.
    - `topology`: `"v5e"` or `"v5p"`.

    **Returns:**

    `{"compiled_for", "resident_gib", "rollout", "update"}`: the arrays the run keeps on the
    chip (the policy and its optimizer state, the reward model, the VAE) and each program's
    plan (`plan_gib`) or `error`.
    """
    from jax.experimental import topologies

    described = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[topology])
    device = described.devices[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("one",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())  # type: ignore[no-untyped-call]
    dtype = jnp.bfloat16 if config.pipeline.dtype == "bfloat16" else jnp.float32
    pipeline = _abstract_pipeline(config)
    shapes = _condition_shapes(config, pipeline.transformer)
    null = {name: np.zeros((1, *shape), np.float32) for name, shape in shapes.items()}
    clip = eqx.filter_eval_shape(lambda: _random_clip("pickscore", dtype))
    terms = [DeviceTerm("pickscore", 1.0, PickScore(clip), None)]
    plan = MeshPlan.of(config)
    job = Job.build(config, plan, pipeline, null, terms, [], None)
    state = eqx.filter_eval_shape(job.trainer.init, jax.random.key(0))
    job = job.without_model_arrays()
    rows = {name: jax.ShapeDtypeStruct((plan.rollout_rows, *shape), dtype)  # type: ignore[no-untyped-call]
            for name, shape in shapes.items()}  # fmt: skip
    rows[terms[0].row_key] = jax.ShapeDtypeStruct((plan.rollout_rows, 1024), jnp.float32)  # type: ignore[no-untyped-call]
    key = jax.eval_shape(lambda: jax.random.key(0))
    first = jax.ShapeDtypeStruct((), jnp.int32)  # type: ignore[no-untyped-call]
    policy = job.objective.sampling_policy(state.variables)
    rollout_arguments = _abstract((job.rollout, policy, rows, key, first, terms), sharding)
    kind: str = getattr(device, "device_kind", topology)
    report: dict[str, Any] = {"compiled_for": f"{kind} (one chip, ahead of time)"}
    report["resident_gib"] = round(
        sum(
            leaf.size * getattr(leaf.dtype, "itemsize", 0)
            for leaf in jax.tree.leaves((state, terms, pipeline.vae))
            if isinstance(leaf, jax.ShapeDtypeStruct)
        )
        / 2**30,
        2,
    )
    report["rollout"] = _compile(rollout_program.__wrapped__, rollout_arguments)  # type: ignore[attr-defined]
    minibatch = _transitions(job, rows, plan.update_rows)
    update_arguments = _abstract((job.trainer, minibatch, state), sharding)
    report["update"] = _compile(
        lambda trainer, rows_, state_: trainer._update(state_, rows_, True),
        update_arguments,
        donate=(2,),
    )
    return report
