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
        assert "_objective" not in path.read_text() and "_nft" not in path.read_text()


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
