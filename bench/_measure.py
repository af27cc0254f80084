"""Measure one `Setup`: every figure is a ratio of things timed side by side in this run."""

import dataclasses
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx.train import Trainer, TrainState, rl_epoch

from . import _baselines
from ._setups import Setup
from ._timing import compile_counter, interleave, log, median, summary


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much to measure."""

    rounds_step: int
    rounds_rollout: int
    recompiles: bool
    memory: bool


def own_copy(tree: Any) -> Any:
    """Fresh buffers, so that donating a train state frees nothing this module still uses."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def lower_step(
    trainer: Trainer, batch: fg.Transitions, state: TrainState, *, compile: bool = True
) -> Any:
    """The lowered (and by default compiled) program of `trainer.update(state, batch)`.

    Compiling it ahead of time fills the same cache that `trainer.update` then uses.
    """
    from flowgrpo_eqx.train import _trainer

    jitted: Any = getattr(_trainer, "_update_donating", None)
    if jitted is None:
        # Should the private name change: the same `_update`, without donation.

        def update(trainer_batch_checked: Any, state: Any) -> Any:
            return trainer_batch_checked[0]._update(state, *trainer_batch_checked[1:])

        jitted = eqx.filter_jit(update)
    # `True`: the advantages checked on the host first, as `Trainer.update` does.
    lowered = jitted.lower((trainer, batch, True), state).lowered
    return lowered.compile() if compile else lowered


def xla_flops(compiled: Any) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    return float(analysis["flops"])


def temp_bytes(compiled: Any) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def first_transitions(batch: fg.Transitions, k: int) -> fg.Transitions:
    """The batch restricted to its first `k` recorded transitions."""

    def per_transition(b: fg.Transitions) -> tuple[jax.Array, ...]:
        return (
            b.latents,
            b.next_latents,
            b.timesteps,
            b.next_timesteps,
            b.old_log_probs,
            b.transition_mask,
        )

    sliced = tuple(leaf[:, :k] for leaf in per_transition(batch))
    out: fg.Transitions = eqx.tree_at(per_transition, batch, sliced)
    if batch.advantages.ndim == 2:
        out = eqx.tree_at(lambda b: b.advantages, out, batch.advantages[:, :k])
    return out


def _scheduled(setup: Setup, schedule: fg.AbstractWindowSchedule) -> tuple[Any, Trainer]:
    """The setup's rollout and trainer with `schedule` placing the stochastic window (the
    objective's SDE without a window of its own)."""
    rollout = setup.rollout
    sde = setup.objective.sde
    free = fg.FlowSDE(sde.noise_level, window=None, kl_weighting=sde.kl_weighting)
    objective = eqx.tree_at(lambda o: o.sde, setup.objective, free)
    scheduled = fg.FlowRollout(
        objective,
        rollout.reward,
        groups=rollout.groups,
        steps=rollout.steps,
        sampler=fg.SDESampler(free, window_schedule=schedule),
        advantage_std=rollout.advantage_std,
        mesh=rollout.mesh,
    )
    return scheduled, setup.make_trainer(objective)


def recompiles(setup: Setup, epochs_after_warmup: int = 3) -> dict[str, Any]:
    """Compilations in `rl_epoch` (rollout + updates) after one warmup epoch, for the
    setup's rollout and again with a random and a sliding window schedule (the window moves
    every epoch: its position is traced, so nothing recompiles)."""
    counter = compile_counter()
    transitions = setup.rollout.steps - 1
    recorded = setup.rollout.recorded_transitions
    # A window that can move: the setup's own length, or half the trajectory if it has all.
    count = recorded if recorded < transitions else max(1, transitions // 2)
    variants: dict[str, tuple[Any, Trainer]] = {
        "fixed": (setup.rollout, setup.trainer),
        "random": _scheduled(setup, fg.RandomWindow(count)),
        "sliding": _scheduled(setup, fg.SlidingWindow(count, shift_every=1)),
    }
    per_schedule: dict[str, list[int]] = {}
    starts: dict[str, list[int]] = {}
    for name, (rollout, trainer) in variants.items():
        state = trainer.init(jax.random.key(11))
        run_key = jax.random.key(12)
        counts = []
        starts[name] = []
        for epoch in range(1 + epochs_after_warmup):
            counter.start()
            state, _, info = rl_epoch(
                trainer,
                state,
                rollout,
                setup.rows(epoch),
                jax.random.fold_in(run_key, epoch),
                epoch=epoch + 1,
            )
            jax.block_until_ready(state)  # type: ignore[no-untyped-call]
            counts.append(counter.stop())
            starts[name].append(info.window_start)
            log(f"{setup.name}: {name} window, epoch {epoch} compiled {counts[-1]} program(s)")
        per_schedule[name] = counts
    return {
        "recompiles_after_warmup": int(sum(sum(c[1:]) for c in per_schedule.values())),
        "compiles_per_epoch": per_schedule,
        "window_starts": starts,
        "epochs_after_warmup": epochs_after_warmup,
        "event": "/jax/core/compile/backend_compile_duration",
    }


def memory(setup: Setup, batch: fg.Transitions, state: TrainState) -> dict[str, Any]:
    """Compiled temporary memory of the training step at K=10 vs K=1, per transition chunk."""
    k = batch.num_transitions
    out: dict[str, Any] = {"temp_bytes": {}}
    ratios = {}
    by_program: dict[str, int] = {}  # identical programs (K=1 is one chunk either way) once
    for label, chunk in (("chunk_1", 1), ("chunk_default", None)):
        trainer = setup.make_trainer(setup.make_objective(chunk))
        sizes = {}
        for kk in (k, 1):
            started = time.perf_counter()
            lowered = lower_step(trainer, first_transitions(batch, kk), state, compile=False)
            text = lowered.as_text()
            if text not in by_program:
                by_program[text] = temp_bytes(lowered.compile())
                seconds = time.perf_counter() - started
                log(f"{setup.name}: compiled step {label} K={kk} in {seconds:.1f}s")
            sizes[f"K{kk}"] = by_program[text]
        out["temp_bytes"][label] = sizes
        ratios[label] = round(sizes[f"K{k}"] / sizes["K1"], 4)
    out["ratios"] = ratios
    out["distinct_programs_compiled"] = len(by_program)
    return out


def measure(setup: Setup, plan: Plan) -> dict[str, Any]:
    started = time.perf_counter()
    rollout, trainer, objective = setup.rollout, setup.trainer, setup.objective
    result: dict[str, Any] = {}
    detail: dict[str, Any] = {}

    if plan.recompiles:
        log(f"{setup.name}: recompile check (1 warmup epoch + 3 epochs of rl_epoch)")
        checked = recompiles(setup)
        result["recompiles_after_warmup"] = checked["recompiles_after_warmup"]
        detail["recompiles"] = checked
    else:
        result["recompiles_after_warmup"] = None

    log(f"{setup.name}: first rollout")
    state = trainer.init(jax.random.key(0))
    variables = own_copy(state.variables)
    rows = setup.rows(0)
    batch, _ = rollout.collect(variables.policy, rows, jax.random.key(1))
    jax.block_until_ready(batch)  # type: ignore[no-untyped-call]
    n, k = batch.num_rows, batch.num_transitions
    guided = 2 if objective.flow.guidance is not None else 1
    model_inputs = guided * n * k

    log(f"{setup.name}: compiling the step for cost and memory analysis")
    compiled_step = lower_step(trainer, batch, state)
    step_flops = xla_flops(compiled_step)
    flops = {"step_xla": step_flops, "model_inputs_per_pass": model_inputs}
    if setup.analytic_flops is not None:
        analytic = setup.analytic_flops(model_inputs)
        flops["step_analytic_2_weights_inputs_passes"] = analytic
        flops["xla_over_analytic"] = round(step_flops / analytic, 4)

    if plan.memory:
        mem = memory(setup, batch, state)
        result["memory_k10_over_k1"] = mem["ratios"]
        detail["memory"] = mem
    del compiled_step

    # -- group A: matmul, training step, bare model work -----------------------------------
    log(f"{setup.name}: compiling the bare model work")
    work, compiled_work = _baselines.model_work(objective, variables, batch)
    flops["model_work_xla"] = xla_flops(compiled_work)
    matmul, matmul_flops = _baselines.matmul_baseline()
    holder = {"state": trainer.init(jax.random.key(2))}

    def step() -> Any:
        holder["state"], metrics = trainer.update(holder["state"], batch)
        return holder["state"], metrics

    group = {"matmul": matmul, "step": step, "model_work": work}
    if setup.layer_dims is not None:
        shaped, flops["shaped_matmuls"] = _baselines.shaped_matmuls(
            setup.layer_dims, model_inputs, objective.beta > 0
        )
        group["shaped_matmuls"] = shaped
    log(f"{setup.name}: timing {' / '.join(group)}, {plan.rounds_step} rounds")
    timings = interleave(group, plan.rounds_step)

    def utilization(name: str, count: float, clock: str) -> np.ndarray:
        return (count / matmul_flops) * timings.per_round("matmul", name, clock)

    result["step_utilization"] = median(utilization("step", step_flops, "wall"))
    result["flops_source"] = "xla_cost_analysis"
    result["objective_overhead"] = median(timings.per_round("step", "model_work"))
    detail["step_utilization"] = summary(utilization("step", step_flops, "wall"))
    detail["objective_overhead"] = summary(timings.per_round("step", "model_work"))
    detail["model_work_utilization"] = summary(
        utilization("model_work", flops["model_work_xla"], "wall")
    )
    if setup.layer_dims is not None:
        detail["shaped_matmuls_utilization"] = summary(
            utilization("shaped_matmuls", flops["shaped_matmuls"], "wall")
        )
        detail["shaped_matmuls_definition"] = (
            "only the step's matmuls (forward, weight and input gradients, reference forward) "
            "at its shapes, nothing else: the ceiling for step_utilization at these shapes"
        )
        detail["step_over_shaped_matmuls"] = summary(timings.per_round("step", "shaped_matmuls"))
    detail["flops"] = flops
    detail["matmul_baseline"] = f"{_baselines.MATMUL_SIZE}x{_baselines.MATMUL_SIZE} float32 @ "
    detail["matmul_baseline"] += f"{_baselines.MATMUL_SIZE}x{_baselines.MATMUL_SIZE}, jit"
    cpu_clock = {
        "step_utilization": median(utilization("step", step_flops, "cpu")),
        "objective_overhead": median(timings.per_round("step", "model_work", "cpu")),
        "model_work_utilization": median(utilization("model_work", flops["model_work_xla"], "cpu")),
    }
    absolute = {
        name: round(1e3 * float(np.median(values)), 2) for name, values in timings.wall.items()
    }
    holder.clear()

    # -- group B: generation, collect, bare guided forwards ---------------------------------
    device_rows = _baselines.repeat_rows(rows, rollout.groups)
    bare_rollout = _baselines.model_rollout(rollout, variables.policy, device_rows)
    keys = iter(jax.random.split(jax.random.key(3), 10_000))
    infos: list[Any] = []

    def generate() -> Any:
        return rollout.generate(variables.policy, device_rows, next(keys))

    def collect() -> Any:
        collected, info = rollout.collect(variables.policy, rows, next(keys))
        infos.append(info)
        return collected

    variants = {"generate": generate, "collect": collect, "model_rollout": bare_rollout}
    log(f"{setup.name}: timing {' / '.join(variants)}, {plan.rounds_rollout} rounds")
    rollout_timings = interleave(variants, plan.rounds_rollout)
    result["rollout_overhead"] = median(rollout_timings.per_round("generate", "model_rollout"))
    result["rollout_source"] = "rollout.generate (jit-compiled generation, block_until_ready)"
    result["rollout_overhead_collect"] = median(
        rollout_timings.per_round("collect", "model_rollout")
    )
    timed_infos = infos[-plan.rounds_rollout :]
    reward_seconds = np.asarray([info.seconds["reward"] for info in timed_infos])
    generation_seconds = np.asarray([info.seconds["generation"] for info in timed_infos])
    collect_wall = np.asarray(rollout_timings.wall["collect"])
    result["host_reward_share"] = median(reward_seconds / collect_wall)
    detail["rollout_overhead"] = summary(rollout_timings.per_round("generate", "model_rollout"))
    detail["rollout_overhead_collect"] = summary(
        rollout_timings.per_round("collect", "model_rollout")
    )
    detail["host_reward_share"] = summary(reward_seconds / collect_wall)
    detail["host_reward_share_of_info_seconds"] = summary(
        reward_seconds / (reward_seconds + generation_seconds)
    )
    detail["host_reward_definition"] = (
        "info.seconds['reward'] (host transfer, reward, float64 statistics, transport) over "
        "the wall time of the whole FlowRollout.collect call"
    )
    cpu_clock["rollout_overhead"] = median(
        rollout_timings.per_round("generate", "model_rollout", "cpu")
    )
    cpu_clock["rollout_overhead_collect"] = median(
        rollout_timings.per_round("collect", "model_rollout", "cpu")
    )
    absolute.update(
        {
            name: round(1e3 * float(np.median(values)), 2)
            for name, values in rollout_timings.wall.items()
        }
    )

    detail["cpu_clock_ratios"] = cpu_clock
    detail["median_ms_absolute_informational"] = absolute
    detail["N"], detail["K"] = n, k
    detail["seconds_to_measure"] = round(time.perf_counter() - started, 1)
    result["detail"] = detail
    return result
