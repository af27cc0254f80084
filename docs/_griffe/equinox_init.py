"""A griffe extension: the `__init__` that `eqx.Module` generates, for the API reference.

Equinox builds a dataclass `__init__` for every `eqx.Module` without one of its own. Static
analysis cannot see it, so the reference would show such a class with no signature. This
extension imports the class, reads the generated signature (field order, defaults, static
fields and inherited fields included), and gives the class an `__init__` with those
parameters, annotated with the fields' own (statically read, so cross-linked) annotations.
"""

import importlib
import inspect
from typing import Any

import equinox as eqx
import griffe


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _runtime_class(cls: griffe.Class) -> Any:
    try:
        obj: Any = importlib.import_module(cls.module.path)
    except ImportError:
        return None
    for part in cls.path[len(cls.module.path) + 1 :].split("."):
        obj = getattr(obj, part, None)
    return obj


def _field_annotation(cls: griffe.Class, name: str) -> Any:
    try:
        member = cls.all_members.get(name)
    except Exception:  # an unresolvable base class: fall back to the class's own members
        member = cls.members.get(name)
    if isinstance(member, griffe.Attribute):
        return member.annotation
    return None


class EquinoxInit(griffe.Extension):
    """Give each `eqx.Module` without an `__init__` of its own the one Equinox generates."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__init__" in cls.members:
            return
        runtime = _runtime_class(cls)
        if not (inspect.isclass(runtime) and issubclass(runtime, eqx.Module)):
            return
        if "__init__" not in vars(runtime) or inspect.isabstract(runtime):
            return
        parameters = [
            griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
        ]
        for name, parameter in inspect.signature(runtime).parameters.items():
            default = None
            if parameter.default is not inspect.Parameter.empty:
                default = repr(parameter.default)
            parameters.append(
                griffe.Parameter(
                    name,
                    annotation=_field_annotation(cls, name),
                    kind=_KINDS[parameter.kind],
                    default=default,
                )
            )
        cls.set_member(
            "__init__",
            griffe.Function(
                "__init__",
                lineno=0,
                endlineno=0,
                parent=cls,
                parameters=griffe.Parameters(*parameters),
                returns="None",
            ),
        )
