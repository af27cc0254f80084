"""The porting check: it passes on a correct setup (the shapes demo, a user MLP) and each
deliberately broken setup fails on the line that names its fault."""

import itertools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
from flowgrpo_eqx.shapes_demo import cli
from flowgrpo_eqx.shapes_demo.config import make_config
from flowgrpo_eqx.shapes_demo.job import ShapesJob
from flowgrpo_eqx.train import Trainer, default_optimizer
from tests.cli_helpers import compilation_cache, with_base
from tests.errors import NAMED_ARGUMENT_ERRORS


DIM = 4
COND_DIM = 2
PROMPTS = 2


class VectorMLP(eqx.Module):
    """A user MLP on vectors, conditioned on a float vector."""

    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(DIM + COND_DIM + 1, 16, key=k1),
            eqx.nn.Linear(16, 16, key=k2),
            eqx.nn.Linear(16, DIM, key=k3),
        )

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        h = jnp.concatenate([x, cond, t[None]])
        h = jax.nn.silu(self.layers[0](h))
        h = jax.nn.silu(self.layers[1](h))
        return self.layers[2](h)


_TRACES = itertools.count()


class DropoutLeftOn(eqx.Module):
    """Dropout left in training mode, its key drawn inside the model: every trace of the
    model (the rollout's, the rescoring's) drops different units."""

    inner: VectorMLP
    dropout: eqx.nn.Dropout

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        key = jax.random.key(next(_TRACES))
        return self.dropout(self.inner(x, t, cond), key=key)


class FrozenMiddle(eqx.Module):
    """A model whose middle layer sits behind `stop_gradient`: it can never train."""

    inner: VectorMLP

    def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
        first, middle, last = self.inner.layers
        h = jax.nn.silu(first(jnp.concatenate([x, cond, t[None]])))
        h = jax.nn.silu(jax.lax.stop_gradient(middle)(h))
        return last(h)


def quadratic_reward(samples: np.ndarray, rows: Any) -> np.ndarray:
    """A deterministic float64 reward: closeness of each sample to the origin."""
    del rows
    return -np.mean(np.asarray(samples, np.float64) ** 2, axis=1)


def float32_noise_reward(samples: np.ndarray, rows: Any) -> np.ndarray:
    """A broken reward: fresh float32 noise at every call."""
    del rows
    return np.random.default_rng().normal(size=len(samples)).astype(np.float32)


def user_setup(
    model: Any, reward: Any = quadratic_reward, beta: float = 0.0
) -> tuple[fg.FlowGRPOObjective, fg.FlowRollout, fg.FlowGRPOVariables, np.ndarray]:
    objective = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(),
        fg.InputSpec(null=jnp.zeros((COND_DIM,), jnp.float32), latent_shape=(DIM,)),
        beta=beta,
        clip_range=0.2,
        guidance=fg.CFG(2.0),
        steps=4,
    )
    rollout = fg.FlowRollout(objective, reward, groups=4, steps=4)
    rows = np.random.default_rng(0).normal(size=(PROMPTS, COND_DIM)).astype(np.float32)
    return objective, rollout, objective.init(jax.random.key(0)), rows


def check(
    model: Any, reward: Any = quadratic_reward, beta: float = 0.0, **options: Any
) -> fg.ConsistencyReport:
    objective, rollout, variables, rows = user_setup(model, reward, beta)
    return fg.check_consistency(objective, rollout, variables, rows, jax.random.key(1), **options)


def failed_names(report: fg.ConsistencyReport) -> set[str]:
    return {line.name for line in report.failed}


def broken_factory() -> tuple[Any, ...]:
    """A `--factory` target: the dropout model."""
    inner = VectorMLP(jax.random.key(0))
    return user_setup(DropoutLeftOn(inner, eqx.nn.Dropout(0.5, inference=False)))


# ------------------------------------------------------------------------------------------
# A correct user setup passes, every line.


def test_user_mlp_passes_every_line_with_reference_kl() -> None:
    report = check(VectorMLP(jax.random.key(0)), beta=0.1)
    assert report.passed, str(report)
    names = [line.name for line in report.lines]
    assert "KL at init" in names
    assert report.line("KL at init").value == 0.0
    assert report.line("kept transitions").value == PROMPTS * 4 * 3
    assert report.line("zero-gradient arrays").detail.endswith("of 6 trainable arrays")
    # beta > 0: the reference's six arrays are snapshotted and must not move.
    assert report.line("frozen arrays changed").detail.endswith(
        "of 6 frozen arrays (the policy's and the other variables')"
    )
    table = str(report)
    assert table == report.table()
    assert table.splitlines()[0].split() == ["check", "value", "threshold", "verdict", "detail"]
    assert table.splitlines()[-1] == f"PASSED: {len(names)} of {len(names)} checks passed."


# ------------------------------------------------------------------------------------------
# Each broken setup fails on its own line.


def test_dropout_in_rescoring_fails_the_log_prob_ratio_and_kl_lines() -> None:
    inner = VectorMLP(jax.random.key(0))
    report = check(DropoutLeftOn(inner, eqx.nn.Dropout(0.5, inference=False)), beta=0.1)
    assert not report.passed
    failed = failed_names(report)
    assert {"log-prob gap max", "log-prob gap mean", "KL at init"} <= failed
    assert {"ratio min", "ratio max"} & failed
    assert float(report.line("log-prob gap max").value) > 1e-3
    assert "worst at row" in report.line("log-prob gap max").detail
    # The collect itself is repeatable (one compiled rollout), and the reward is fine.
    assert "rollout reproducible" not in failed
    assert not {name for name in failed if name.startswith("reward")}
    assert "FAIL" in str(report)
    assert str(report).splitlines()[-1].startswith("FAILED:")


def test_float32_noise_reward_fails_the_reward_and_reproducibility_lines() -> None:
    report = check(VectorMLP(jax.random.key(0)), reward=float32_noise_reward)
    failed = failed_names(report)
    assert {"reward dtype", "reward repeatable", "rollout reproducible"} <= failed
    assert report.line("reward dtype").value == "float32"
    assert "reward shape" not in failed
    assert "reward finite" not in failed
    # Rescoring is still exact: the fault is the reward's alone.
    assert "log-prob gap max" not in failed


def test_frozen_layer_is_named_by_the_gradient_line() -> None:
    report = check(FrozenMiddle(VectorMLP(jax.random.key(0))))
    assert failed_names(report) == {"zero-gradient arrays"}
    line = report.line("zero-gradient arrays")
    assert line.value == 2
    assert "policy.inner.layers[1].weight" in line.detail
    assert "policy.inner.layers[1].bias" in line.detail
    assert "layers[0]" not in line.detail and "layers[2]" not in line.detail


def test_trainable_filter_freezes_arrays_that_then_stay_put() -> None:
    """A layer the trainer's filter leaves out is neither asked for a gradient nor changed."""
    model = VectorMLP(jax.random.key(0))
    trainable = jax.tree.map(lambda _: True, eqx.filter(model, eqx.is_array))
    trainable = eqx.tree_at(lambda m: m.layers[0], trainable, replace_fn=lambda layer: False)
    objective, rollout, variables, rows = user_setup(model)
    trainer = Trainer(objective, default_optimizer(1e-2), trainable=trainable)
    report = fg.check_consistency(
        objective, rollout, variables, rows, jax.random.key(1), trainer=trainer
    )
    assert report.passed, str(report)
    assert report.line("zero-gradient arrays").detail.endswith("of 4 trainable arrays")
    # beta = 0: the frozen layer's two arrays, and no reference.
    assert report.line("frozen arrays changed").detail.endswith(
        "of 2 frozen arrays (the policy's and the other variables')"
    )


def test_bfloat16_model_gap_is_measured_and_thresholds_can_be_loosened() -> None:
    """The check measures rather than assumes: on one CPU a bf16 model repeats its rounding
    exactly in rescoring (each row's arithmetic does not depend on the batch), elsewhere
    kernels chosen by batch shape may not; either way the verdict follows the threshold."""
    model = jax.tree.map(
        lambda leaf: leaf.astype(jnp.bfloat16) if eqx.is_inexact_array(leaf) else leaf,
        VectorMLP(jax.random.key(0)),
    )

    class Bfloat16(eqx.Module):
        inner: VectorMLP

        def __call__(self, x: jax.Array, t: jax.Array, cond: jax.Array) -> jax.Array:
            low = self.inner(
                x.astype(jnp.bfloat16), t.astype(jnp.bfloat16), cond.astype(jnp.bfloat16)
            )
            return low.astype(jnp.float32)

    strict = check(Bfloat16(model))
    loose = check(
        Bfloat16(model),
        thresholds=fg.ConsistencyThresholds(log_prob_gap=1.0, ratio=1.0, clip_fraction=1.0),
    )
    assert loose.passed, str(loose)
    gap = float(strict.line("log-prob gap max").value)
    assert gap == float(loose.line("log-prob gap max").value)
    assert ("log-prob gap max" in failed_names(strict)) == (gap > 1e-6)


def test_thresholds_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="`kl`"):
        fg.ConsistencyThresholds(kl=-1.0)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="ratio"):
        fg.ConsistencyThresholds(ratio="tight")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no such line"):
        fg.ConsistencyReport((fg.CheckLine("a", 1, "== 1", True),)).line("no such line")


# ------------------------------------------------------------------------------------------
# The demo, through the API and the command line (on the session's tiny base model).


@pytest.fixture(scope="module")
def tiny_out(tmp_path_factory: pytest.TempPathFactory, tiny_base: Any) -> Any:
    return with_base(tiny_base, tmp_path_factory.mktemp("check"))


def test_cli_check_passes_on_the_tiny_demo(tiny_out: Any, capsys: pytest.CaptureFixture) -> None:
    # As `flowgrpo-eqx check` would, with the compilation cache the demo's processes share.
    with compilation_cache():
        status = cli.main(["check", "--preset", "tiny", "--quiet", "--out", str(tiny_out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "log-prob gap max" in printed
    assert "zero-gradient arrays" in printed
    assert "PASSED:" in printed and "FAIL" not in printed


def test_demo_passes_in_float32_with_ratio_one(tiny_out: Any) -> None:
    job = ShapesJob(make_config("tiny", beta=0.01), tiny_out, quiet=True)
    base, _ = job.base_model(lambda message: None)
    objective = job.flow_grpo_objective(base)
    report = fg.check_consistency(
        objective,
        job.rollout(objective),
        objective.init(jax.random.key(0)),
        job.epoch_rows(1),
        jax.random.key(3),
        trainer=job.trainer(objective),
    )
    assert report.passed, str(report)
    assert float(report.line("log-prob gap max").value) <= 1e-6
    for name in ("ratio mean", "ratio min", "ratio max"):
        assert abs(float(report.line(name).value) - 1.0) <= 1e-6
    assert report.line("clip fraction").value == 0.0
    assert float(report.line("KL at init").value) <= 1e-7


def test_cli_check_with_a_user_factory_exits_one(capsys: pytest.CaptureFixture) -> None:
    with compilation_cache():
        status = cli.main(["check", "--factory", "tests.test_consistency:broken_factory"])
    printed = capsys.readouterr().out
    assert status == 1
    gap_line = next(line for line in printed.splitlines() if line.startswith("log-prob gap max"))
    assert "FAIL" in gap_line
    assert printed.splitlines()[-1].startswith("FAILED:")
