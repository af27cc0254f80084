"""Settings as frozen dataclasses whose fields carry their help text and bounds, checked
against their declared types when a section is made: what the shapes demo's settings and the
real-model trainer's configuration share.

A setting is a field made by `setting` (its default, help and bounds); a section is a class
decorated with `section`. A bad value raises a `ValueError` that names the setting.
"""

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar

from ._misc import check_int, check_number


MAX_SEED = 2**32 - 1
"""The largest seed a setting takes (NumPy's range; JAX keys take the seed plus a small
offset as a 64-bit int)."""


def setting(default: Any, help: str, **bounds: int | float | bool) -> Any:
    """A setting: its default, its help text, and for a number the bounds that `check_int`
    or `check_number` holds it to (`minimum`, `maximum`, `include_minimum`,
    `include_maximum`)."""
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds})


def seed_setting(help: str) -> Any:
    """A seed: 0 by default, any unsigned 32-bit integer."""
    return setting(0, help, minimum=0, maximum=MAX_SEED)


def split_optional(annotation: Any) -> tuple[bool, Any]:
    """Whether a setting's type admits `None`, and the type without it.

    **Arguments:**

    - `annotation`: the field's type (`X | None` and `Optional[Literal[...]]` alike).

    **Returns:**

    `(optional, base)`: `base` is `X` for an optional type, else `annotation` itself.
    """
    args = typing.get_args(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    if not (union and type(None) in args):
        return False, annotation
    return True, next(a for a in args if a is not type(None))


def check_setting(name: str, annotation: Any, value: Any, bounds: dict[str, Any]) -> None:
    """Check one setting against its declared type: a `Literal`'s values, a bool, a bounded
    int or number, a string, a tuple of `Literal` values; `X | None` also allows `None`.

    **Raises:**

    - `ValueError`: `"Setting `name` must be ..."`.
    """
    optional, base = split_optional(annotation)
    if optional and value is None:
        return
    none = " or none" if optional else ""
    try:
        if typing.get_origin(base) is Literal:
            allowed = typing.get_args(base)
            if value not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}{none}, got {value!r}.")
        elif typing.get_origin(base) is tuple:
            item_type = typing.get_args(base)[0]
            if typing.get_origin(item_type) is Literal:
                allowed = typing.get_args(item_type)
                if not isinstance(value, tuple) or any(item not in allowed for item in value):
                    raise ValueError(f"`{name}` must name values from {allowed}, got {value!r}.")
            elif not isinstance(value, tuple) or not all(
                isinstance(item, item_type) for item in value
            ):
                raise ValueError(
                    f"`{name}` must be a list of {item_type.__name__} values, got {value!r}."
                )
        elif base is bool:
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be true or false, got {value!r}.")
        elif base is int:
            check_int(name, value, bounds["minimum"], optional=optional)
            if "maximum" in bounds and value > bounds["maximum"]:
                raise ValueError(
                    f"`{name}` must be an int in {bounds['minimum']}..{bounds['maximum']}, "
                    f"got {value!r}."
                )
        elif base is float:
            check_number(name, value, optional=optional, **bounds)
        elif not isinstance(value, base):
            raise ValueError(f"`{name}` must be a {base.__name__}{none}, got {value!r}.")
    except ValueError as error:
        # The library's checks say `None`; a setting is written `none` in flags and files.
        raise ValueError(f"Setting {str(error).replace('None or ', 'none or ')}") from None


_Section = TypeVar("_Section")


@typing.dataclass_transform(frozen_default=True)
def section(cls: type[_Section]) -> type[_Section]:
    """`cls` as a frozen dataclass whose fields are checked against their types and bounds
    when it is made (`check_fields`), before its own `__post_init__`, if it has one."""
    own_check = cls.__dict__.get("__post_init__")

    def post_init(self: Any) -> None:
        check_fields(self)
        if own_check is not None:
            own_check(self)

    setattr(cls, "__post_init__", post_init)  # noqa: B010
    return dataclasses.dataclass(frozen=True)(cls)


def check_fields(section: Any) -> None:
    """Check every field of a section against its declared type and bounds.

    **Raises:**

    - `ValueError`: naming the first setting of the wrong type or outside its range.
    """
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        check_setting(field.name, hints[field.name], value, field.metadata["bounds"])
