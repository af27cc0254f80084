"""What a bad argument raises, for tests of argument checking."""

from jaxtyping import TypeCheckError


NAMED_ARGUMENT_ERRORS = (ValueError, TypeCheckError)
"""A mode typed `Literal[...]` given an unknown value raises the library's `ValueError`; under
this test suite's runtime type checker (jaxtyping with beartype) the checker's
`TypeCheckError` comes first. Both name the argument, which the tests match."""
