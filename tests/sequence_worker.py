"""Run by `tests/test_sequence_parallel.py` on 4 simulated devices: sequence-parallel attention
(both strategies) against `plain_attention` on one device, values and gradients.

Prints one JSON line: per strategy, the largest difference of the values and of each input's
gradient over the largest value of the one-device result, and the error of a sequence the axis
does not divide.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from flowgrpo_eqx.models._layers import plain_attention
from flowgrpo_eqx.models._sequence import SEQUENCE_STRATEGIES, sequence_parallel_attention


def relative(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main() -> None:
    assert jax.device_count() == 4, jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("sequence",))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, (2, 24, 4, 8), jnp.float32) for key in keys)

    def objective(attention):
        return lambda q, k, v: jnp.vdot(jax.vmap(attention)(q, k, v), cotangent)

    want = jax.vmap(plain_attention)(q, k, v)
    want_grads = jax.grad(objective(plain_attention), argnums=(0, 1, 2))(q, k, v)
    report = {}
    for strategy in SEQUENCE_STRATEGIES:

        def split(q, k, v, strategy=strategy):
            return sequence_parallel_attention(q, k, v, mesh, "sequence", strategy)

        got = jax.jit(jax.vmap(split))(q, k, v)
        grads = jax.jit(jax.grad(objective(split), argnums=(0, 1, 2)))(q, k, v)
        report[strategy] = {
            "values": relative(got, want),
            "gradients": [relative(a, b) for a, b in zip(grads, want_grads, strict=True)],
        }
    try:
        sequence_parallel_attention(q[0, :6], k[0, :6], v[0, :6], mesh, "sequence", "ring")
    except ValueError as error:
        report["indivisible"] = str(error)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
