"""The seams between the library's parts: which way imports flow, and what variables hold."""

import ast
import dataclasses
import inspect
import pathlib

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
