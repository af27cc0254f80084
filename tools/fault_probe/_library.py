"""Faults of the library: what a researcher gets wrong when calling `import flowgrpo_eqx`
directly. Settings no objective, SDE, process, rollout, reward, trainer or LoRA model can
hold; batches of the wrong shape, dtype or values; damaged or mismatched model, adapter and
checkpoint files. Each fault runs in a fresh interpreter of the checkout (as `python` runs
one, with a compilation cache shared by the group), so that a crash or a hang is seen as
such, on a tiny MLP velocity of 4 latent dimensions.

A snippet catches what the library raises and prints one marker line: `RAISED <type> <its
classes> | <message>` or `RETURNED <JSON of what came back>`. A refusal is `named` when its
exception is one of the fault's expected types (`ValueError`, `TypeError`, `RewardError`,
`EquinoxRuntimeError`, `CheckpointError`, ... or a subclass) and its message holds one of
the fault's names (the argument as the API spells it, the file); a return is `held` only
where the fault says why that is the right outcome, else `accepted`."""

import dataclasses
import functools
import json
import pathlib
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._probe import Fault, Finding, Judgement, Ran, environment, raw_failure, run


GROUP = "library"
LIMIT = 150.0
"""Seconds a snippet may take: a fault that rolls out and updates the tiny MLP takes about
15 on a busy 2-core machine, most of it importing JAX and compiling."""

NAMED_ERRORS: tuple[str, ...] = ("ValueError", "TypeError")
"""The exception types (or their subclasses, such as `RewardError`) a refusal may have."""
RUNTIME_ERRORS: tuple[str, ...] = ("ValueError", "TypeError", "EquinoxRuntimeError")
"""Also `eqx.error_if`'s error, raised from inside a compiled update."""
FILE_ERRORS: tuple[str, ...] = ("ValueError", "CheckpointError", "OSError")
"""Refusals of a file: `CheckpointError` (a `ValueError`), or the file system's own."""

PRELUDE = """\
import json
import os
import pathlib
import warnings

warnings.filterwarnings("ignore")
os.chdir({workdir!r})
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.models import MLPVelocity
from flowgrpo_eqx.train import Trainer, default_optimizer
"""
"""What every snippet starts with: the imports, run in the fault's own folder."""

OBJECTIVE = """\
model = MLPVelocity(4, 2, hidden=16, depth=1, time_features=8, key=jax.random.key(0))
spec = fg.InputSpec(select="cond", null=jnp.zeros(2), latent_shape=(4,))


def flow_grpo(**settings):
    options = {"clip_range": 0.2, "steps": 4, **settings}
    velocity = options.pop("model", model)
    inputs = options.pop("inputs", spec)
    return fg.FlowGRPOObjective(velocity, fg.RectifiedFlow(), inputs, **options)


objective = flow_grpo()
ROWS = {"cond": np.eye(2, dtype=np.float32)[[0, 1, 0]], "goal": np.array([0.5, -0.5, 0.5])}


def reward(samples, rows):
    return -np.abs(samples.mean(axis=1) - rows["goal"])


def rollout(objective=objective, reward=reward, groups=4):
    return fg.FlowRollout(objective, reward, groups=groups, steps=4)
"""
"""A Flow-GRPO objective on the tiny MLP (as docs/concepts.md builds it), its rows and a
reward; `rollout()` samples it in groups of 4 on a 4-point grid."""

BATCH = """\
N, K = 8, 3
rng = np.random.default_rng(0)
grid = np.linspace(1.0, 0.0, K + 1, dtype=np.float32)
FIELDS = {
    "latents": jnp.asarray(rng.normal(size=(N, K, 4)), jnp.float32),
    "next_latents": jnp.asarray(rng.normal(size=(N, K, 4)), jnp.float32),
    "timesteps": jnp.asarray(np.broadcast_to(grid[:-1], (N, K))),
    "next_timesteps": jnp.asarray(np.broadcast_to(grid[1:], (N, K))),
    "old_log_probs": jnp.zeros((N, K), jnp.float32),
    "transition_mask": jnp.ones((N, K), bool),
    "advantages": jnp.asarray(rng.normal(size=N), jnp.float32),
    "cond": {"cond": jnp.asarray(np.eye(2, dtype=np.float32)[rng.integers(0, 2, N)])},
}


def transitions(**fields):
    return fg.Transitions(**{**FIELDS, **fields})


batch = transitions()
trainer = Trainer(objective, default_optimizer(1e-3))


def policy_arrays(state):
    arrays = eqx.filter(state.variables.policy, eqx.is_array)
    return [np.asarray(a) for a in jax.tree.leaves(arrays)]


def update(batch, trainer=trainer):
    state = trainer.init(jax.random.key(1))
    before = policy_arrays(state)
    state, metrics = trainer.update(state, batch)
    after = policy_arrays(state)
    return {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "finite": all(bool(np.all(np.isfinite(a))) for a in after),
        "moved": any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True)),
    }
"""
"""A hand-made `Transitions` batch of 8 rows and 3 transitions on the uniform grid (as a
researcher porting recorded data builds one), a `Trainer`, and `update(batch)`: one update
from a fresh state, reported as its loss, gradient norm and whether the policy stayed finite
and moved."""

ADAPTERS = """\
lora_model = lora.add(model, 2, key=jax.random.key(3))
lora.save_adapters("policy.lora", lora_model)
SAVED = pathlib.Path("policy.lora").read_bytes()
HEADER, ARRAYS = SAVED.split(b"\\n", 1)
"""
"""The tiny MLP with rank-2 adapters, saved to `policy.lora` by `lora.save_adapters`."""

CHECKPOINT = """\
from flowgrpo_eqx.train import Checkpointer, save_model, load_model

state = Trainer(objective).init(jax.random.key(1))
checkpoints = Checkpointer("checkpoints")
"""
"""A fresh train state of the tiny MLP and a `Checkpointer` on `checkpoints/`."""

TEMPLATE = """\
try:
{setup}
except Exception as error:
    print("SETUP-FAILED", type(error).__name__, " ".join(str(error).split())[:300])
    raise SystemExit(3)
try:
{body}
except Exception as error:
    classes = ",".join(c.__name__ for c in type(error).__mro__)
    print("RAISED", type(error).__name__, classes, "|", " ".join(str(error).split()))
else:
    print("RETURNED", json.dumps(result, default=str))
"""


Check = Callable[[dict[str, Any]], str | None]
"""Why what a snippet returned is the right outcome (`held`), or `None` (`accepted`)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One fault of the library.

    **Arguments:**

    - `name`: what the researcher does, as the report names it.
    - `setup`: the code run before the fault (after `PRELUDE`); it must not fail.
    - `body`: the fault itself; it sets `result` (a JSON-able dict) when nothing is raised.
    - `names`: words one of which a refusal's message must hold (case-insensitive).
    - `errors`: the exception classes a refusal may be of (by name, anywhere in its MRO).
    - `held`: for a fault the library may take, why the returned `result` is right (or
        `None` when it is not); by default a return is `accepted`.
    - `empty`: a folder (relative to the fault's folder) that must be empty or absent
        afterwards (what a refused save must not leave behind).
    """

    name: str
    setup: str
    body: str
    names: tuple[str, ...]
    errors: tuple[str, ...] = NAMED_ERRORS
    held: Check | None = None
    empty: str | None = None


def program(case: Case, workdir: pathlib.Path) -> str:
    """The snippet of `case`, run in `workdir`: `PRELUDE`, the setup, then the fault's body
    with its outcome printed as one marker line."""
    return PRELUDE.format(workdir=str(workdir)) + TEMPLATE.format(
        setup=textwrap.indent((case.setup.strip() or "pass") + "\n", "    "),
        body=textwrap.indent(case.body.strip() + "\n", "    "),
    )


def marker(ran: Ran) -> tuple[str, str]:
    """The last marker line of a snippet's output: `(kind, rest)` with kind `RAISED`,
    `RETURNED` or `SETUP-FAILED`; a `Finding` (`unprobed`) when there is none."""
    for line in reversed(ran.stdout.splitlines()):
        kind, _, rest = line.partition(" ")
        if kind in ("RAISED", "RETURNED", "SETUP-FAILED"):
            return kind, rest
    tail = (ran.stderr.strip() or ran.stdout.strip() or "(silent)").splitlines()[-1]
    raise Finding("unprobed", f"no outcome printed (exit {ran.status}): {tail[:200]}")


def excerpt(message: str, names: Sequence[str], width: int = 200) -> str:
    """Up to `width` characters of `message` from a little before the first of `names` it
    holds (its start when it holds none): the line a user would read."""
    lowered = message.lower()
    found = [lowered.find(name.lower()) for name in names if name.lower() in lowered]
    start = max(min(found) - 60, 0) if found else 0
    prefix = "..." if start else ""
    return prefix + message[start : start + width]


def essential(message: str) -> str:
    """What an error says, without the stack an `EquinoxRuntimeError` prints before its own
    message (the stack names the library's functions, e.g. `_finite_advantages`, which must
    not count as naming the argument) and without its debugging advice after it."""
    own = "EquinoxRuntimeError: "
    if own not in message:
        return message
    return message.rsplit(own, 1)[1].split(" ----", 1)[0].strip()


def judge(case: Case, ran: Ran, workdir: pathlib.Path) -> Judgement:
    """The verdict of `case` from its snippet's run (see the module's docstring)."""
    failure = raw_failure(ran, LIMIT)
    if failure is not None:
        return failure
    kind, rest = marker(ran)
    if kind == "SETUP-FAILED":
        raise Finding("unprobed", f"the fault's setup failed: {rest[:200]}")
    if kind == "RETURNED":
        value: dict[str, Any] = json.loads(rest)
        reason = case.held(value) if case.held is not None else None
        if reason is not None:
            return Judgement("held", reason)
        return Judgement("accepted", f"returned {json.dumps(value)[:240]}")
    head, _, said = rest.partition(" | ")
    error, _, classes = head.partition(" ")
    message = essential(said)
    if case.empty is not None and (left := _entries(workdir / case.empty)):
        return Judgement("litter", f"{case.empty}/ left holding {left}: {error}: {message[:120]}")
    line = f"{error}: {excerpt(message, case.names)}"
    if not set(classes.split(",")) & set(case.errors):
        return Judgement("unnamed", f"not one of {list(case.errors)}: {line}")
    if not any(name.lower() in message.lower() for name in case.names):
        return Judgement("unnamed", f"names none of {list(case.names)}: {line}")
    return Judgement("named", line)


def _entries(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@functools.cache
def _cache_dir() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="fault-probe-library-cache-"))


def _env() -> dict[str, str]:
    """A snippet's environment (`environment`), sharing one JAX compilation cache across the
    group: most snippets compile the same small programs (the MLP's initialisation, the
    update, the rollout), and a fresh interpreter would compile each again."""
    return environment(
        JAX_COMPILATION_CACHE_DIR=str(_cache_dir()),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def probe(case: Case) -> Callable[[pathlib.Path], Judgement]:
    """The probe of `case`: its snippet run in a fresh interpreter in the fault's folder."""

    def carry_out(workdir: pathlib.Path) -> Judgement:
        command = [sys.executable, "-c", program(case, workdir)]
        ran = run(command, timeout=LIMIT, cwd=workdir, env=_env())
        return judge(case, ran, workdir)

    return carry_out


# --------------------------------------------------------------------------------------
# What a returned result must show for the library to have held.


def _finite_grid(value: Mapping[str, Any]) -> str | None:
    grid = value["grid"]
    finite = all(isinstance(t, float) and t == t and abs(t) != float("inf") for t in grid)
    if finite and grid[0] == 1.0 and grid[-1] == 0.0:
        return f"a finite grid from 1 to 0: {grid}"
    return None


def _finite_update(value: Mapping[str, Any]) -> str | None:
    if value["finite"] and value["loss"] == value["loss"]:
        return (
            f"computed in float32 as documented (compute_dtype): loss {value['loss']:.4g}, "
            "parameters finite"
        )
    return None


def _nothing_kept(value: Mapping[str, Any]) -> str | None:
    if value["loss"] == 0.0 and value["grad_norm"] == 0.0 and value["finite"]:
        return "no transition kept: loss 0, zero gradient, parameters finite (documented D = 0)"
    return None


def _restorable(value: Mapping[str, Any]) -> str | None:
    if value["restored"]:
        return f"saved as {value['saved']} and restored from it"
    return None


def _control_finite(check: Check) -> Check:
    """`check`, after making sure the same update on the unharmed batch stayed finite (the
    fault, not the probe's batch, is judged)."""

    def checked(value: dict[str, Any]) -> str | None:
        if not value["control"]["finite"]:
            raise Finding("unprobed", f"the unharmed batch's update is not finite: {value}")
        return check(value)

    return checked


def _refused_and_kept(value: Mapping[str, Any]) -> str | None:
    """Refused first (the message naming the advantages on its first line), and the state
    the caller holds left whole: it trained on the next batch."""
    refused = value["refused"] or ""
    if refused.startswith("ValueError: `batch.advantages`") and value["deleted"] == 0:
        if value["loss"] == value["loss"]:
            return f"refused ({refused[:80]}...); the state then trained on a good batch"
    return None


def _never(value: Mapping[str, Any]) -> str | None:
    del value
    return None


# --------------------------------------------------------------------------------------
# The faults.

SETTINGS: tuple[Case, ...] = (
    Case(
        "Trainer(objective, 'adam')",
        OBJECTIVE,
        "Trainer(objective, 'adam')\nresult = {'built': 'Trainer with a str optimizer'}",
        ("`optimizer`",),
    ),
    Case(
        "clip_range -0.2",
        OBJECTIVE,
        "result = {'built': repr(flow_grpo(clip_range=-0.2).clip_range)}",
        ("`clip_range`",),
    ),
    Case(
        "clip_range NaN",
        OBJECTIVE,
        "result = {'built': repr(flow_grpo(clip_range=float('nan')).clip_range)}",
        ("`clip_range`",),
    ),
    Case(
        "beta NaN",
        OBJECTIVE,
        "result = {'built': repr(flow_grpo(beta=float('nan')).beta)}",
        ("`beta`",),
    ),
    Case(
        "noise_level -0.7",
        "",
        "result = {'built': repr(fg.FlowSDE(noise_level=-0.7))}",
        ("`noise_level`",),
    ),
    Case(
        "noise_level NaN",
        "",
        "result = {'built': repr(fg.CoefficientsPreservingSDE(noise_level=float('nan')))}",
        ("`noise_level`",),
    ),
    Case(
        "noise_level inf",
        "",
        """
sde = fg.FlowSDE(noise_level=float("inf"))
x, v = jnp.ones(4), jnp.ones(4)
mean, std = sde.transition(x, v, 0.5, 0.25)
result = {"built": repr(sde), "mean": np.asarray(mean).tolist(), "std": float(std)}
""",
        ("`noise_level`",),
    ),
    Case(
        "RectifiedFlow shift inf",
        "",
        """
grid = fg.RectifiedFlow(shift=float("inf")).timesteps(5)
result = {"grid": np.asarray(grid).tolist()}
""",
        ("`shift`",),
        held=_finite_grid,
    ),
    Case(
        "one-point time grid",
        "",
        "result = {'grid': np.asarray(fg.RectifiedFlow().timesteps(1)).tolist()}",
        ("`steps`",),
    ),
    Case(
        "increasing time grid for an SDE window",
        "",
        """
window = fg.window_for_indices(jnp.linspace(0.0, 1.0, 5), 0, 2)
result = {"window": window, "sde": repr(fg.FlowSDE(window=window))}
""",
        ("`window`", "grid"),
    ),
    Case(
        "evaluate_policy with steps=0",
        OBJECTIVE,
        """
rows = {"cond": np.eye(2, dtype=np.float32)}
out = fg.evaluate_policy(objective.flow, fg.Euler(), 0, model, rows, jax.random.key(0))
result = {"latents": np.asarray(out.latents).tolist()}
""",
        ("`steps`",),
    ),
    Case(
        "solver class instead of an instance",
        "",
        "result = {'built': repr(fg.ODESampler(fg.Heun))}",
        ("`solver`",),
    ),
    Case(
        "DiffusionNFT beta 0",
        OBJECTIVE,
        "result = {'beta': fg.DiffusionNFTObjective(objective.flow, beta=0.0).beta}",
        ("`beta`",),
    ),
    Case(
        "DiT given an image of another size",
        "",
        """
from flowgrpo_eqx.models import DiT

dit = DiT(image_size=16, patch=4, width=16, depth=1, heads=2, key=jax.random.key(0))
v = dit(jnp.zeros((8, 8, 3)), jnp.asarray(0.5), jnp.zeros(4, jnp.int32))
result = {"shape": list(v.shape)}
""",
        ("`x`",),
    ),
    Case(
        "window schedule longer than the trajectory",
        OBJECTIVE,
        """
sampler = fg.SDESampler(objective.sde, window_schedule=fg.FixedWindow(count=8))
fg.FlowRollout(objective, reward, groups=4, steps=4, sampler=sampler)
result = {"built": "a rollout of 3 transitions with a window of 8"}
""",
        ("`count`",),
    ),
)

ROLLOUTS: tuple[Case, ...] = (
    Case(
        "model output shaped unlike its input",
        OBJECTIVE,
        """
class Doubled(eqx.Module):
    inner: MLPVelocity

    def __call__(self, x, t, cond):
        return jnp.concatenate([self.inner(x, t, cond), x])


bad = flow_grpo(model=Doubled(model))
batch, info = rollout(bad).collect(bad.flow.model, ROWS, jax.random.key(2))
result = {"rewards": info.rewards.tolist()}
""",
        ("velocity",),
    ),
    Case(
        "null condition of another shape",
        OBJECTIVE,
        """
bad = flow_grpo(inputs=fg.InputSpec(select="cond", null=jnp.zeros(3), latent_shape=(4,)))
batch, info = rollout(bad).collect(model, ROWS, jax.random.key(2))
result = {"rewards": info.rewards.tolist()}
""",
        ("null",),
    ),
    Case(
        "latent_shape of another rank than the model's",
        OBJECTIVE,
        """
bad = flow_grpo(inputs=fg.InputSpec(select="cond", null=jnp.zeros(2), latent_shape=(2, 2)))
batch, info = rollout(bad).collect(model, ROWS, jax.random.key(2))
result = {"rewards": info.rewards.tolist()}
""",
        ("`x`", "latent"),
    ),
    Case(
        "integer seed as the rollout key",
        OBJECTIVE,
        """
batch, info = rollout().collect(model, ROWS, 0)
result = {"rewards": info.rewards.tolist()}
""",
        ("key",),
    ),
    Case(
        "reward returning NaN",
        OBJECTIVE,
        """
def nan_at_row_2(samples, rows):
    scores = reward(samples, rows)
    scores[2] = np.nan
    return scores


batch, info = rollout(reward=nan_at_row_2).collect(model, ROWS, jax.random.key(2))
result = {"rewards": info.rewards.tolist(), "advantages": np.asarray(batch.advantages).tolist()}
""",
        ("non-finite", "nan"),
    ),
    Case(
        "zero source rows",
        OBJECTIVE,
        """
empty = {"cond": np.zeros((0, 2), np.float32), "goal": np.zeros(0)}
batch, info = rollout().collect(model, empty, jax.random.key(2))
result = {"rows": batch.num_rows, "rewards": info.rewards.tolist()}
""",
        ("rows", "empty"),
    ),
    Case(
        "source rows of unequal lengths",
        OBJECTIVE,
        """
ragged = {"cond": np.eye(2, dtype=np.float32)[[0, 1, 0]], "goal": np.array([0.5, -0.5])}
batch, info = rollout().collect(model, ragged, jax.random.key(2))
result = {"rows": batch.num_rows, "rewards": info.rewards.tolist()}
""",
        ("`rows`", "goal", "leading axis"),
    ),
    Case(
        "rl_epoch with inner_epochs=-1",
        OBJECTIVE,
        """
from flowgrpo_eqx.train import rl_epoch

trainer = Trainer(objective, default_optimizer(1e-3))
state = trainer.init(jax.random.key(1))
state, metrics, info = rl_epoch(
    trainer, state, rollout(), ROWS, jax.random.key(3), inner_epochs=-1
)
result = {"step": int(state.step), "loss": metrics.get("loss", "none")}
""",
        ("`inner_epochs`",),
    ),
)

ADVANTAGES: tuple[Case, ...] = (
    Case(
        "group size 1 in group_advantages",
        OBJECTIVE,
        """
advantages = fg.group_advantages(np.array([0.1, 0.7, 0.3, 0.9]), groups=1)
try:
    rollout(groups=1)
    single = "built"
except ValueError as error:
    single = f"refused: {error}"
result = {"advantages": advantages.tolist(), "FlowRollout(groups=1)": single}
""",
        ("`groups`",),
    ),
    Case(
        "rewards not divisible into groups",
        "",
        "result = {'advantages': fg.group_advantages(np.arange(6.0), groups=4).tolist()}",
        ("`groups`",),
    ),
    Case(
        "NaN reward in group_advantages",
        "",
        "result = {'advantages': fg.group_advantages([1.0, float('nan'), 2.0, 3.0], 2).tolist()}",
        ("`rewards`",),
    ),
)

REWARDS: tuple[Case, ...] = tuple(
    Case(
        f"empty batch to {label}",
        "from flowgrpo_eqx.shapes_demo.job import BUILTIN_REWARDS",
        f"""
reward = {build}
samples = np.zeros((0, 16, 16, 3), np.float32)
scores = reward(samples, {{"tokens": np.zeros((0, 4), np.int64)}})
result = {{"scores": np.asarray(scores).tolist()}}
""",
        ("empty", "`samples`"),
    )
    for label, build in (
        ("JpegCompressibility", "fg.JpegCompressibility()"),
        ("JpegIncompressibility", "fg.JpegIncompressibility()"),
        ("WeightedReward", "fg.WeightedReward([(fg.JpegCompressibility(), 1.0)])"),
        ("HttpReward", "fg.HttpReward('http://127.0.0.1:9', retries=0, timeout=1.0)"),
        ("the partial shapes reward", "BUILTIN_REWARDS['partial']()"),
        ("the strict shapes reward", "BUILTIN_REWARDS['strict']()"),
    )
) + (
    Case(
        "WeightedReward with a NaN weight",
        "",
        "result = {'name': fg.WeightedReward([(fg.JpegCompressibility(), float('nan'))]).name}",
        ("`terms`", "weight"),
    ),
)

UPDATES: tuple[Case, ...] = (
    Case(
        "NaN advantages in Trainer.update",
        OBJECTIVE + BATCH,
        "result = update(transitions(advantages=FIELDS['advantages'].at[3].set(jnp.nan)))",
        ("advantages",),
    ),
    Case(
        "inf advantages in Trainer.update",
        OBJECTIVE + BATCH,
        "result = update(transitions(advantages=FIELDS['advantages'].at[0].set(jnp.inf)))",
        ("advantages",),
    ),
    Case(
        "NaN advantages refused, then the same state updated again",
        OBJECTIVE + BATCH,
        """
state = trainer.init(jax.random.key(1))
try:
    trainer.update(state, transitions(advantages=FIELDS["advantages"].at[3].set(jnp.nan)))
    refused = None
except Exception as error:
    refused = f"{type(error).__name__}: {str(error).splitlines()[0]}"
deleted = sum(leaf.is_deleted() for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array))
state, metrics = trainer.update(state, batch)
result = {"refused": refused, "deleted": deleted, "loss": float(metrics["loss"])}
""",
        ("advantages",),
        held=_refused_and_kept,
    ),
    Case(
        "advantages of shape [N+1] in Trainer.update",
        OBJECTIVE + BATCH,
        "result = update(eqx.tree_at(lambda b: b.advantages, batch, jnp.zeros(N + 1)))",
        ("advantages",),
    ),
    Case(
        "advantages of shape [N, K+1]",
        OBJECTIVE + BATCH,
        "result = {'built': repr(transitions(advantages=jnp.zeros((N, K + 1))).advantages)}",
        ("advantages",),
    ),
    Case(
        "latents of a lower rank in Transitions",
        OBJECTIVE + BATCH,
        """
flat = transitions(
    latents=FIELDS["latents"][:, 0], next_latents=FIELDS["next_latents"][:, 0]
)
result = update(flat)
""",
        ("latents",),
    ),
    Case(
        "int latents in Transitions",
        OBJECTIVE + BATCH,
        "result = update(transitions(latents=FIELDS['latents'].astype(jnp.int32)))",
        ("latents",),
    ),
    Case(
        "float16 latents in Trainer.update",
        OBJECTIVE + BATCH,
        """
result = update(
    transitions(
        latents=FIELDS["latents"].astype(jnp.float16),
        next_latents=FIELDS["next_latents"].astype(jnp.float16),
    )
)
""",
        ("latents", "float16"),
        held=_finite_update,
    ),
    Case(
        "transition times increasing in Trainer.update",
        OBJECTIVE + BATCH,
        """
control = update(batch)
reversed_times = transitions(
    timesteps=FIELDS["next_timesteps"], next_timesteps=FIELDS["timesteps"]
)
result = {**update(reversed_times), "control": control}
""",
        ("timesteps", "next_timesteps"),
        RUNTIME_ERRORS,
        held=_control_finite(_never),
    ),
    Case(
        "FinalSamples batch in a Flow-GRPO Trainer.update",
        OBJECTIVE + BATCH,
        """
samples = fg.FinalSamples(FIELDS["latents"][:, -1], FIELDS["advantages"], FIELDS["cond"])
result = update(samples)
""",
        ("Transitions", "FinalSamples", "`batch`"),
    ),
    Case(
        "GRPOGuard without recorded means",
        OBJECTIVE + BATCH,
        "result = update(batch, Trainer(flow_grpo(guard=fg.GRPOGuard())))",
        ("old_means", "record_means"),
    ),
    Case(
        "microbatches not dividing the rows",
        OBJECTIVE + BATCH,
        "result = update(batch, Trainer(objective, default_optimizer(1e-3), microbatches=3))",
        ("`microbatches`",),
    ),
    Case(
        "minibatch_rows not dividing the rows",
        OBJECTIVE + BATCH,
        """
from flowgrpo_eqx.train import minibatches

result = {"minibatches": len(list(minibatches(batch, 3, jax.random.key(0))))}
""",
        ("`minibatch_rows`",),
    ),
    Case(
        "trainable filter selecting nothing",
        OBJECTIVE + BATCH,
        """
frozen = Trainer(objective, default_optimizer(1e-3), trainable=lambda leaf: False)
result = update(batch, frozen)
""",
        ("`trainable`",),
    ),
    Case(
        "every advantage zero in Trainer.update",
        OBJECTIVE + BATCH,
        """
nothing = transitions(advantages=jnp.zeros(N), transition_mask=jnp.zeros((N, K), bool))
result = update(nothing)
""",
        ("advantages",),
        held=_nothing_kept,
    ),
)

LORA: tuple[Case, ...] = (
    Case(
        "LoRA rank 0",
        OBJECTIVE,
        "result = {'rank': lora.add(model, 0, key=jax.random.key(3)).rank}",
        ("`rank`",),
    ),
    Case(
        "LoRA rank -2",
        OBJECTIVE,
        "result = {'rank': lora.add(model, -2, key=jax.random.key(3)).rank}",
        ("`rank`",),
    ),
    Case(
        "truncated adapter file",
        OBJECTIVE + ADAPTERS,
        """
pathlib.Path("policy.lora").write_bytes(SAVED[: len(SAVED) - 40])
result = {"rank": lora.load_adapters("policy.lora", model).rank}
""",
        ("policy.lora",),
        FILE_ERRORS,
    ),
    Case(
        "adapter file with bytes appended",
        OBJECTIVE + ADAPTERS,
        """
pathlib.Path("policy.lora").write_bytes(SAVED + b"appended by another writer")
result = {"rank": lora.load_adapters("policy.lora", model).rank}
""",
        ("policy.lora",),
        FILE_ERRORS,
    ),
    Case(
        "adapter file header without its fingerprint",
        OBJECTIVE + ADAPTERS,
        """
header = json.loads(HEADER)
del header["fingerprint"]
pathlib.Path("policy.lora").write_bytes(json.dumps(header).encode() + b"\\n" + ARRAYS)
result = {"rank": lora.load_adapters("policy.lora", model).rank}
""",
        ("policy.lora", "fingerprint"),
        FILE_ERRORS,
    ),
    Case(
        "adapters loaded onto another base model",
        OBJECTIVE + ADAPTERS,
        """
other = MLPVelocity(4, 2, hidden=16, depth=1, time_features=8, key=jax.random.key(9))
result = {"rank": lora.load_adapters("policy.lora", other).rank}
""",
        ("fingerprint",),
        FILE_ERRORS,
    ),
)

FILES: tuple[Case, ...] = (
    Case(
        "truncated policy file",
        OBJECTIVE + CHECKPOINT,
        """
save_model("policy.eqx", model)
data = pathlib.Path("policy.eqx").read_bytes()
pathlib.Path("policy.eqx").write_bytes(data[: len(data) // 2])
result = {"loaded": repr(load_model("policy.eqx", model))[:80]}
""",
        ("policy.eqx",),
        FILE_ERRORS,
    ),
    Case(
        "policy file of another model shape",
        OBJECTIVE + CHECKPOINT,
        """
save_model("policy.eqx", model)
wider = MLPVelocity(4, 2, hidden=32, depth=1, time_features=8, key=jax.random.key(0))
result = {"loaded": repr(load_model("policy.eqx", wider))[:80]}
""",
        ("policy.eqx",),
        FILE_ERRORS,
    ),
    Case(
        "truncated checkpoint array file",
        OBJECTIVE + CHECKPOINT,
        """
folder = checkpoints.save(1, state, {})
stored = [p for p in (folder / "state").rglob("*") if p.is_file()]
largest = max(stored, key=lambda p: p.stat().st_size)
largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
restored, meta = checkpoints.restore(state)
result = {"step": meta["step"]}
""",
        ("ckpt_00000001",),
        FILE_ERRORS,
    ),
    Case(
        "checkpoint restored into another model shape",
        OBJECTIVE + CHECKPOINT,
        """
checkpoints.save(1, state, {})
wider = MLPVelocity(4, 2, hidden=32, depth=1, time_features=8, key=jax.random.key(0))
like = Trainer(flow_grpo(model=wider)).init(jax.random.key(1))
restored, meta = checkpoints.restore(like)
result = {"step": meta["step"]}
""",
        ("ckpt_00000001",),
        FILE_ERRORS,
    ),
    Case(
        "negative checkpoint step",
        OBJECTIVE + CHECKPOINT,
        """
saved = checkpoints.save(-1, state, {})
found = checkpoints.restore_latest(state, report=lambda line: None)
result = {
    "saved": saved.name,
    "listed": [p.name for p in checkpoints.paths()],
    "restored": found is not None,
}
""",
        ("`step`",),
        held=_restorable,
    ),
    Case(
        "a Checkpointer on a file",
        "from flowgrpo_eqx.train import Checkpointer",
        """
pathlib.Path("hostname").write_text("a-machine\\n")
result = {"latest": repr(Checkpointer("hostname").latest_metadata())}
""",
        ("hostname: is a file, not a folder",),
        ("CheckpointError",),
    ),
    Case(
        "checkpoint saves past a file-size limit",
        OBJECTIVE + CHECKPOINT,
        """
import resource

jax.config.update("jax_enable_compilation_cache", False)
rng = np.random.default_rng(0)
large = {f"w{i}": jnp.asarray(rng.normal(size=100_000), jnp.float32) for i in range(4)}
large["n"] = rng.integers(0, 1 << 30, 200_000).astype(np.int32)
# Python ignores SIGXFSZ: a write past the limit fails with EFBIG, one write among several
# TensorStore runs at once. Five saves, since what the others do after it is a race.
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, hard))
failures = []
for step in range(1, 6):
    try:
        checkpoints.save(step, large, {})
    except OSError as error:
        failures.append(error)
if failures:
    raise failures[0]
result = {"saved": [p.name for p in checkpoints.paths()]}
""",
        ("File too large while writing a checkpoint",),
        ("OSError",),
        empty="checkpoints",
    ),
    Case(
        "numpy scalar in checkpoint metadata",
        OBJECTIVE + CHECKPOINT,
        """
saved = checkpoints.save(1, state, {"reward_mean": np.float32(0.5)})
result = {"saved": saved.name}
""",
        ("`metadata`", "reward_mean"),
        empty="checkpoints",
    ),
)

CASES: tuple[Case, ...] = SETTINGS + ROLLOUTS + ADVANTAGES + REWARDS + UPDATES + LORA + FILES


def faults() -> list[Fault]:
    """Every fault of the library group, one fresh interpreter each."""
    return [Fault(GROUP, case.name, probe(case)) for case in CASES]
