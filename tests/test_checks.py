"""The shared argument checks and the chunked random draw of `flowgrpo_eqx._misc`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx._misc import check_int, check_leading_rows, check_number, chunked_random_arrays


@pytest.mark.parametrize(
    "value, bounds, allowed",
    [
        (0, {"minimum": 0, "include_minimum": False}, "a finite number > 0"),
        (-1.0, {"minimum": 0}, "a finite number >= 0"),
        (math.inf, {}, "a finite number"),
        (math.nan, {"minimum": 0}, "a finite number >= 0"),
        (True, {"minimum": 0}, "a finite number >= 0"),
        ("1", {}, "a finite number"),
        (1.0, {"minimum": 0, "maximum": 1, "include_maximum": False}, "a finite number in [0, 1)"),
        (0, {"minimum": 0, "maximum": 1, "include_minimum": False}, "a finite number in (0, 1]"),
        (2, {"maximum": 1}, "a finite number <= 1"),
        (1, {"maximum": 1, "include_maximum": False}, "a finite number < 1"),
        (None, {"minimum": 0}, "a finite number >= 0"),
        (-1, {"minimum": 0, "optional": True}, "None or a finite number >= 0"),
    ],
)
def test_check_number_names_the_argument_and_the_range(value, bounds, allowed):
    with pytest.raises(ValueError) as caught:
        check_number("alpha", value, **bounds)
    assert str(caught.value) == f"`alpha` must be {allowed}, got {value!r}."


@pytest.mark.parametrize(
    "value, bounds",
    [
        (0, {"minimum": 0}),
        (1, {"minimum": 0, "maximum": 1}),
        (np.float32(0.5), {"minimum": 0, "maximum": 1, "include_minimum": False}),
        (np.int64(3), {}),
        (None, {"optional": True}),
    ],
)
def test_check_number_accepts_numbers_in_range(value, bounds):
    check_number("alpha", value, **bounds)


def test_check_int_refuses_bools_and_floats():
    for value in (True, 1.0, 0):
        with pytest.raises(ValueError, match=r"^`rank` must be an int >= 1, got "):
            check_int("rank", value, 1)
    check_int("rank", np.int32(2), 1)


def test_check_leading_rows_names_the_leaf():
    tree = {"a": np.zeros((3, 2)), "b": [np.zeros((3,)), np.zeros((2, 1))]}
    with pytest.raises(ValueError) as caught:
        check_leading_rows("FinalSamples", "cond", tree, 3)
    assert str(caught.value) == (
        "FinalSamples.cond['b'][1] has shape (2, 1), expected a leading axis of size N = 3."
    )
    with pytest.raises(ValueError, match=r"cond\['a'\] has shape \(\), .* size B = 3\.$"):
        check_leading_rows("SupervisedBatch", "cond", {"a": np.float32(1)}, 3, rows_name="B")
    check_leading_rows("FinalSamples", "cond", {"a": np.zeros((3, 2))}, 3)


def test_chunked_random_arrays_are_the_same_eagerly_and_traced():
    key = jax.random.key(0)
    specs = [((3, 70_000), 0.5), ((4,), 2.0)]
    dtypes = [jnp.bfloat16, jnp.float32]
    eager = chunked_random_arrays(key, specs, jax.random.normal, dtypes)
    traced = jax.jit(lambda k: chunked_random_arrays(k, specs, jax.random.normal, dtypes))(key)
    for a, b, (shape, _), dtype in zip(eager, traced, specs, dtypes, strict=True):
        assert a.shape == b.shape == shape and a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    first = jax.random.normal(jax.random.fold_in(key, 0), (1 << 16,))
    np.testing.assert_array_equal(
        np.asarray(eager[0], np.float32).reshape(-1)[:8],
        np.asarray((np.asarray(first[:8]) * np.float32(0.5)).astype(jnp.bfloat16), np.float32),
    )
