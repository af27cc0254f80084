"""The wings' rules, read from the package's import statements: reward internals stay inside
`rewards/`, the models import no algorithm, and the objectives import no model."""

import ast
import pathlib


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "flowgrpo_eqx"


def _dotted(path: pathlib.Path) -> str:
    """`flowgrpo_eqx.objectives._dppo` for `flowgrpo_eqx/objectives/_dppo.py`."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, as an absolute dotted name (`from . import x` counts as
    both the package and `package.x`)."""
    package = _dotted(path) if path.name == "__init__.py" else _dotted(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _modules(folder: str = "") -> list[pathlib.Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _inside(name: str, wing: str) -> bool:
    return name == wing or name.startswith(wing + ".")


def test_the_import_reader_resolves_relative_imports() -> None:
    found = imported_modules(PACKAGE / "objectives" / "_dppo.py")
    assert "flowgrpo_eqx.objectives._base" in found
    assert "flowgrpo_eqx._sde" in found
    assert "flowgrpo_eqx.rewards" in imported_modules(PACKAGE / "_rollout.py")


def test_no_module_outside_rewards_imports_reward_internals() -> None:
    """Outside `rewards/`, reward code is reached through `flowgrpo_eqx.rewards` and its
    public modules (`server`, `limits`), never its private ones."""
    found = [
        f"{_dotted(path)} imports {name}"
        for path in _modules()
        if not _inside(_dotted(path), "flowgrpo_eqx.rewards")
        for name in imported_modules(path)
        if _inside(name, "flowgrpo_eqx.rewards")
        and any(part.startswith("_") for part in name.split(".")[2:])
    ]
    assert not found, found


def test_the_models_import_no_algorithm() -> None:
    found = [
        f"{_dotted(path)} imports {name}"
        for path in _modules("models")
        for name in imported_modules(path)
        if _inside(name, "flowgrpo_eqx.objectives") or _inside(name, "flowgrpo_eqx.rewards")
    ]
    assert not found, found


def test_the_objectives_import_no_model() -> None:
    found = [
        f"{_dotted(path)} imports {name}"
        for path in _modules("objectives")
        for name in imported_modules(path)
        if _inside(name, "flowgrpo_eqx.models")
    ]
    assert not found, found


def test_the_distributed_helpers_import_no_reward_code() -> None:
    """The models import the mesh axes from `_distributed`: it must not pull rewards in."""
    found = imported_modules(PACKAGE / "_distributed.py")
    assert not [name for name in found if _inside(name, "flowgrpo_eqx.rewards")], found
