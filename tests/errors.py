"""What a bad argument raises, for tests of argument checking."""

import contextlib
import re
from collections.abc import Iterator

import pytest
from jaxtyping import TypeCheckError


NAMED_ARGUMENT_ERRORS = (ValueError, TypeCheckError)
"""A mode typed `Literal[...]` given an unknown value raises the library's `ValueError`; under
this test suite's runtime type checker (jaxtyping with beartype) the checker's
`TypeCheckError` comes first. Both name the argument, which the tests match."""


def exact_message(message: str) -> str:
    """A `pytest.raises(match=...)` pattern for exactly `message`, case and all."""
    return "^" + re.escape(message) + "$"


@contextlib.contextmanager
def raises_named(message: str) -> Iterator[None]:
    """The library's exact `ValueError` for an argument of the wrong type, or, when the
    runtime type checker of the test suite's default options is on, the checker's error
    (which comes first)."""
    with pytest.raises(NAMED_ARGUMENT_ERRORS) as error:
        yield
    if error.type is ValueError:
        assert str(error.value) == message
