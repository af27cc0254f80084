"""The library's layout: what importing it loads, and how its modules type their settings."""

import inspect
import subprocess
import sys
import typing

import equinox as eqx
import pytest

import flowgrpo_eqx
import flowgrpo_eqx.train


@pytest.mark.several_processes("imports the library in a fresh process")
def test_importing_the_library_loads_no_demo_matplotlib_or_tqdm():
    code = (
        "import sys, flowgrpo_eqx, flowgrpo_eqx.train\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tqdm')"
        " or m.startswith('flowgrpo_eqx.shapes_demo'))\n"
        "print(loaded)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _public_modules():
    for package in (flowgrpo_eqx, flowgrpo_eqx.train):
        for name in dir(package):
            value = getattr(package, name)
            if inspect.isclass(value) and issubclass(value, eqx.Module):
                yield f"{package.__name__}.{name}", value


def test_no_public_module_has_a_field_typed_plain_str():
    modules = dict(_public_modules())
    assert "flowgrpo_eqx.FlowSDE" in modules and "flowgrpo_eqx.train.Trainer" in modules
    for name, module in modules.items():
        for field, annotation in typing.get_type_hints(module).items():
            assert annotation is not str, f"{name}.{field} is typed str; use a Literal"


def test_sde_variants_are_final_classes_of_one_abstract_class():
    for variant in (flowgrpo_eqx.FlowSDE, flowgrpo_eqx.CoefficientsPreservingSDE):
        assert issubclass(variant, flowgrpo_eqx.AbstractSDE)
        assert getattr(variant, "__final__", False)
    weightings = (flowgrpo_eqx.PaperKLWeighting, flowgrpo_eqx.ReleasedKLWeighting)
    for weighting in weightings:
        assert issubclass(weighting, flowgrpo_eqx.AbstractKLWeighting)
        assert getattr(weighting, "__final__", False)
    hint = typing.get_type_hints(flowgrpo_eqx.FlowSDE)["kl_weighting"]
    assert hint is flowgrpo_eqx.AbstractKLWeighting
