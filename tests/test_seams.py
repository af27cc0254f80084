"""The seams between the library's parts: which way imports flow, and what variables hold."""

import ast
import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowgrpo_eqx as fg
import flowgrpo_eqx.models as models
import flowgrpo_eqx.train as train


PACKAGE = pathlib.Path(fg.__file__).parent


def _names_in(path: pathlib.Path) -> set[str]:
    """Every name a module imports or mentions (imports, attributes, plain names)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def test_the_training_package_names_no_concrete_objective():
    concrete = {"FlowGRPOObjective", "DiffusionNFTObjective", "nft_batch"}
    for path in sorted((PACKAGE / "train").glob("*.py")):
        found = _names_in(path) & concrete
        assert not found, f"{path.name} names {sorted(found)}"
        assert "_flow_grpo" not in path.read_text() and "_nft" not in path.read_text()


def _public_classes() -> list[type]:
    modules = [fg, train, fg.lora, models]
    seen: dict[str, type] = {}
    for module in modules:
        for name in dir(module):
            value = getattr(module, name)
            if inspect.isclass(value) and not name.startswith("_"):
                seen[f"{module.__name__}.{name}"] = value
    return list(seen.values())


def test_no_public_class_has_a_field_named_held():
    classes = _public_classes()
    assert len(classes) > 40
    for cls in classes:
        if dataclasses.is_dataclass(cls):
            names = {field.name for field in dataclasses.fields(cls)}
            assert "held" not in names, cls
        assert not hasattr(cls, "held_variables"), cls


def test_every_objective_returns_variables_of_its_own():
    assert issubclass(fg.FlowGRPOObjective, fg.AbstractRLObjective)
    assert issubclass(fg.DiffusionNFTObjective, fg.AbstractRLObjective)
    assert issubclass(train.FlowMatchingObjective, fg.AbstractFlowObjective)
    fields = {
        fg.FlowGRPOVariables: ["policy", "reference"],
        fg.NFTVariables: ["policy", "old_policy", "reference"],
        fg.PolicyVariables: ["policy"],
    }
    for cls, names in fields.items():
        assert issubclass(cls, fg.AbstractVariables)
        assert [field.name for field in dataclasses.fields(cls)] == names
    assert "ema" in {field.name for field in dataclasses.fields(train.TrainState)}


def test_the_demo_imports_only_public_names_of_the_library():
    for path in sorted((PACKAGE / "shapes_demo").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                parts = (node.module or "").split(".")
                private = [part for part in parts if part.startswith("_")]
                assert not private, f"{path.name} imports {node.module}"
                assert not [a.name for a in node.names if a.name.startswith("_")], path.name


def test_no_model_module_imports_another_modules_private_names():
    """The models share layers through shared modules (`_layers`, `_joint`, `_rope`, `_init`),
    never through one model's private names."""
    found = []
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                found += [
                    f"{path.name}: {alias.name} from {node.module}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert not found, found


ALGORITHM_MODULES = (
    "objectives/_flow_grpo",
    "objectives/_nft",
    "objectives/_awm",
    "objectives/_dgpo",
    "objectives/_dppo",
    "objectives/_dancegrpo",
)
"""One module per RL algorithm, in the objectives package: Flow-GRPO (MixGRPO is Flow-GRPO with
a `MixSampler`), DiffusionNFT, AWM, DGPO, Flow-DPPO and DanceGRPO."""

SHARED_MODULES = (
    "objectives/_policy_loss",
    "objectives/_final_samples",
    "objectives/_decay",
    "objectives/_base",
    "objectives/_trainable",
    "_misc",
)
"""Where the algorithms' shared pieces live: the transition objectives' scan and rescoring,
the final-sample objectives' flow-matching pieces, the trailing copies' decay, the
objectives' base classes, the trainable part's filters, and the library's small helpers."""


def _relative_imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """`(module, names)` of each relative import of a module (`from ._nft import a, b`,
    `from . import _nft`), the module as its dotted path below the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            names = [alias.name for alias in node.names]
            if node.module is None:
                found += [(name, []) for name in names]
            else:
                found.append((node.module, names))
    return found


def test_no_algorithm_module_imports_another_algorithm_module():
    """An algorithm reaches another's pieces only through the shared modules."""
    assert all((PACKAGE / f"{name}.py").is_file() for name in ALGORITHM_MODULES + SHARED_MODULES)
    algorithms = {name.split("/")[-1] for name in ALGORITHM_MODULES}
    found = [
        f"{name}.py imports {module}"
        for name in ALGORITHM_MODULES
        for module, _ in _relative_imports(PACKAGE / f"{name}.py")
        if module.split(".")[-1] in algorithms
    ]
    assert not found, found
    for name in SHARED_MODULES:
        imported = {
            module.split(".")[-1] for module, _ in _relative_imports(PACKAGE / f"{name}.py")
        }
        assert not imported & algorithms, f"{name}.py imports an algorithm"


def test_every_objective_module_lives_in_the_objectives_package():
    """No algorithm or shared objective module is left loose at the package's root."""
    loose = [
        name.split("/")[-1]
        for name in ALGORITHM_MODULES + SHARED_MODULES
        if name.startswith("objectives/") and (PACKAGE / f"{name.split('/')[-1]}.py").exists()
    ]
    assert (
        not loose and not (PACKAGE / "_rl.py").exists() and not (PACKAGE / "_flow_base.py").exists()
    )


def test_no_module_imports_another_modules_private_names():
    """Whatever modules share (the algorithms' `SHARED_MODULES` among them) is public in the
    module that holds it: no module of the package imports a private name from another."""
    found = [
        f"{path.relative_to(PACKAGE)}: {name} from {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, names in _relative_imports(path)
        for name in names
        if name.startswith("_")
    ]
    assert not found, found


def concrete_objective_classes() -> list[type]:
    """Every concrete RL objective of the objectives package, read from its modules: the
    `@final` classes that subclass `AbstractRLObjective` (house style makes every concrete
    class final), so a new algorithm's module is found without being listed here."""
    package = importlib.import_module("flowgrpo_eqx.objectives")
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and issubclass(value, fg.AbstractRLObjective)
                and getattr(value, "__final__", False)
            ):
                found[value.__name__] = value
    return [found[name] for name in sorted(found)]


def porting_setup(cls: type) -> tuple[Any, Any, Any, Any]:
    """A small correct setup of objective class `cls` on a user MLP: `(objective, rollout,
    variables, rows)`. Raises `KeyError` for a class this test does not know how to build,
    so a new objective fails here until it gets a setup."""
    from tests.test_consistency import COND_DIM, DIM, PROMPTS, VectorMLP, quadratic_reward

    model = VectorMLP(jax.random.key(0))
    inputs = fg.InputSpec(null=jnp.zeros((COND_DIM,), jnp.float32), latent_shape=(DIM,))
    flow = fg.GuidedFlow(model, fg.RectifiedFlow(), inputs, guidance=fg.CFG(2.0))
    builders = {
        fg.FlowGRPOObjective: lambda: fg.FlowGRPOObjective(
            model, fg.RectifiedFlow(), inputs, clip_range=0.2, guidance=fg.CFG(2.0), steps=4
        ),
        fg.DiffusionNFTObjective: lambda: fg.DiffusionNFTObjective(flow),
        fg.AWMObjective: lambda: fg.AWMObjective(flow),
        fg.DGPOObjective: lambda: fg.DGPOObjective(
            flow, group_size=4, train_timesteps=2, trunc_steps=1
        ),
        fg.FlowDPPOObjective: lambda: fg.FlowDPPOObjective(flow, sde_steps=None),
        fg.DanceGRPOObjective: lambda: fg.DanceGRPOObjective(flow),
    }
    objective = builders[cls]()
    rollout = fg.FlowRollout(objective, quadratic_reward, groups=4, steps=4)
    rows = np.random.default_rng(0).normal(size=(PROMPTS, COND_DIM)).astype(np.float32)
    return objective, rollout, objective.init(jax.random.key(0)), rows


def test_the_objectives_package_holds_every_algorithm():
    names = {cls.__name__ for cls in concrete_objective_classes()}
    assert {
        "FlowGRPOObjective",
        "DiffusionNFTObjective",
        "AWMObjective",
        "DGPOObjective",
        "FlowDPPOObjective",
        "DanceGRPOObjective",
    } <= names


@pytest.mark.parametrize("cls", concrete_objective_classes(), ids=lambda cls: cls.__name__)
def test_the_porting_check_runs_on_every_objective(cls):
    """`check_consistency` takes any objective and passes on a correct setup of each; the
    transition lines apply exactly to the objectives that rescore recorded transitions."""
    objective, rollout, variables, rows = porting_setup(cls)
    report = fg.check_consistency(objective, rollout, variables, rows, jax.random.key(1))
    names = [line.name for line in report.lines]
    assert report.passed, report.table()
    assert {"rollout reproducible", "loss finite", "zero-gradient arrays"} <= set(names)
    assert "frozen arrays changed" in names
    if issubclass(cls, fg.AbstractTransitionObjective):
        assert {"kept transitions", "log-prob gap max", "ratio min", "ratio max"} <= set(names)
    else:
        assert report.line("transition checks").value == "not applicable"
        assert cls.__name__ in report.line("transition checks").detail
