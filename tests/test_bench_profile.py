"""The full-size bench's profile summary: matmul time that XLA fused under another name is
counted as matmul time (`bench._full_size.fusions_with_products`)."""

import jax
import jax.numpy as jnp

from bench._full_size import LOOPS, device_ops, fusions_with_products, op_kind, plan_gib


# The shape of a TPU program's text (abridged from a compiled SD3.5 step): a product fused
# with the next layer norm's statistics under a reduction's name, a reduction alone, and a
# fusion that calls another fusion holding a product.
PROGRAM = """HloModule jit_train, is_scheduled=true

%fused.1 (param_0.1: bf16[8,64], param_1.1: bf16[64,64]) -> f32[8] {
  %param_0.1 = bf16[8,64]{1,0} parameter(0)
  %param_1.1 = bf16[64,64]{1,0} parameter(1)
  %convolution.3 = bf16[8,64]{1,0} convolution(%param_0.1, %param_1.1), dim_labels=bf_io->bf
  %convert.2 = f32[8,64]{1,0} convert(%convolution.3)
  ROOT %reduce.1 = f32[8]{0} reduce(%convert.2, %c), dimensions={1}, to_apply=%add
}

%fused.2 (param_0.2: bf16[8,64]) -> f32[8] {
  %param_0.2 = bf16[8,64]{1,0} parameter(0)
  %convert.3 = f32[8,64]{1,0} convert(%param_0.2)
  ROOT %reduce.2 = f32[8]{0} reduce(%convert.3, %c), dimensions={1}, to_apply=%add
}

%fused.3 (param_0.3: bf16[8,64], param_1.3: bf16[64,64]) -> f32[8] {
  %param_0.3 = bf16[8,64]{1,0} parameter(0)
  %param_1.3 = bf16[64,64]{1,0} parameter(1)
  ROOT %fusion.9 = f32[8]{0} fusion(%param_0.3, %param_1.3), kind=kOutput, calls=%fused.1
}

ENTRY %main.5 (x.1: bf16[8,64], w.1: bf16[64,64]) -> f32[8] {
  %x.1 = bf16[8,64]{1,0} parameter(0)
  %w.1 = bf16[64,64]{1,0} parameter(1)
  %convert_reduce_fusion.15 = f32[8]{0} fusion(%x.1, %w.1), kind=kOutput, calls=%fused.1
  %convert_reduce_fusion.14 = f32[8]{0} fusion(%x.1), kind=kLoop, calls=%fused.2
  %fusion.20 = f32[8]{0} fusion(%x.1, %w.1), kind=kLoop, calls=%fused.3
  ROOT %add.7 = f32[8]{0} add(%convert_reduce_fusion.15, %fusion.20)
}
"""


def test_a_product_fused_under_a_reductions_name_is_counted_as_a_matmul():
    products = fusions_with_products(PROGRAM)
    assert {"convert_reduce_fusion.15", "fusion.20", "convolution.3"} <= products
    assert "convert_reduce_fusion.14" not in products and "add.7" not in products
    assert op_kind("convert_reduce_fusion.15", products) == op_kind("convolution.3", set())
    assert op_kind("convert_reduce_fusion.14", products) == "reductions"
    assert op_kind("fusion.21", products) == "elementwise fusions"
    assert op_kind("while.26", products) == op_kind("conditional.3", products) == LOOPS


def test_a_compiled_programs_products_are_found():
    program = jax.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w), axis=1))
    text = program.lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile().as_text()
    products = fusions_with_products(text)
    assert products  # the product, alone or in the fusion that holds it
    assert all(name in text for name in products)


def test_a_plans_peak_lies_between_its_largest_part_and_the_parts_sum():
    # Two 0.25 GiB products in a row: the argument, the intermediate and the result are all
    # a quarter GiB, so the rounding to two decimals keeps every part.
    square = jax.ShapeDtypeStruct((8192, 8192), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(square).compile()
    plan = plan_gib(compiled.memory_analysis())
    assert set(plan) == {"arguments", "temporaries", "outputs", "aliased", "peak"}
    assert plan["arguments"] == plan["outputs"] == 0.25
    parts = plan["arguments"] + plan["temporaries"] + plan["outputs"]
    assert max(plan["arguments"], plan["outputs"]) <= plan["peak"] <= parts


def test_device_ops_counts_the_device_threads_per_step():
    # Two profiled steps: `fusion.1` ran twice a step on the device's threads (the
    # asynchronous thread included), `copy.2` once; the host thread's event is not a device op.
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "Async XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python3"}},
        *({"ph": "X", "pid": 1, "tid": 1, "name": "fusion.1", "dur": 1500.0} for _ in range(3)),
        {"ph": "X", "pid": 1, "tid": 2, "name": "fusion.1", "dur": 500.0},
        *({"ph": "X", "pid": 1, "tid": 1, "name": "copy.2", "dur": 250.0} for _ in range(2)),
        {"ph": "X", "pid": 2, "tid": 1, "name": "fusion.1", "dur": 9000.0},
    ]
    assert device_ops(events, calls=2) == {"fusion.1": (2.5, 2.0), "copy.2": (0.25, 1.0)}
