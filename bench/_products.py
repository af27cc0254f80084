"""The matrix products a traced program computes, counted from its jaxpr: every
`dot_general`, as often as the program runs it (a scan's body once per iteration), and their
FLOPs. The full-size rows' model FLOPs (`bench/_full_size.py`) and the shaped-matmul ceiling
(`bench/models.py`) both count with it."""

import math
from collections.abc import Iterator
from typing import Any

import jax


def _sub_jaxprs(eqn: Any) -> Iterator[tuple[Any, int]]:
    """The jaxprs an equation runs and how many times each runs."""
    times = int(eqn.params["length"]) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr, times
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item, times


def _made_in(eqn: Any, functions: frozenset[str]) -> bool:
    """Whether a function named in `functions` was on the stack when `eqn` was traced."""
    traceback = eqn.source_info.traceback
    return (
        bool(functions)
        and traceback is not None
        and any(frame.function_name in functions for frame in traceback.frames)
    )


def dot_generals(
    jaxpr: Any, times: int = 1, *, leaving_out: frozenset[str] = frozenset()
) -> dict[tuple, int]:
    """Every `dot_general` of a jaxpr and how often it runs, by shapes, dtypes and parameters,
    but those traced inside a function named in `leaving_out`."""
    found: dict[tuple, int] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and not _made_in(eqn, leaving_out):
            lhs, rhs = (v.aval for v in eqn.invars)
            key = (
                lhs.shape,
                str(lhs.dtype),
                rhs.shape,
                str(rhs.dtype),
                eqn.params["dimension_numbers"],
                eqn.params["precision"],
                eqn.params["preferred_element_type"],
            )
            found[key] = found.get(key, 0) + times
        for sub, count in _sub_jaxprs(eqn):
            for key, n in dot_generals(sub, times * count, leaving_out=leaving_out).items():
                found[key] = found.get(key, 0) + n
    return found


def dot_flops(dots: dict[tuple, int]) -> int:
    """The FLOPs of `dot_generals`' matmuls, each as often as it runs: `2 x` batch x free
    sizes of both sides x contracted size."""
    flops = 0
    for (lhs_shape, _, rhs_shape, _, dims, _, _), count in dots.items():
        (contract, rhs_contract), (batch, rhs_batch) = dims
        out_size = math.prod(
            size
            for axis, size in enumerate(lhs_shape)
            if axis not in contract and axis not in batch
        ) * math.prod(
            size
            for axis, size in enumerate(rhs_shape)
            if axis not in rhs_contract and axis not in rhs_batch
        )
        batch_size = math.prod(lhs_shape[axis] for axis in batch)
        contract_size = math.prod(lhs_shape[axis] for axis in contract)
        flops += 2 * count * batch_size * out_size * contract_size
    return flops
