"""`bench.scale`'s own parts: counting the collectives of a compiled program, and the
command line's checks (the bench itself compiles models too large for a test)."""

import pytest

from bench import scale


def test_collectives_are_counted_by_kind_once_per_op():
    hlo = """
  %all-gather-start.1 = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), dimensions={0}
  %all-gather-done.1 = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %all-gather-start.1)
  %all-to-all.3 = f32[8,2]{1,0} all-to-all(f32[8,2]{1,0} %x), dimensions={0}
  %all-to-all.4 = f32[8,2]{1,0} all-to-all(f32[8,2]{1,0} %y), dimensions={0}
  %collective-permute.2 = f32[8]{0} collective-permute(f32[8]{0} %k), source_target_pairs={{0,1}}
  %all-reduce.7 = f32[] all-reduce(f32[] %s), to_apply=%add
"""
    assert scale.collectives(hlo) == {
        "all-gather": 1,
        "all-reduce": 1,
        "reduce-scatter": 0,
        "all-to-all": 2,
        "collective-permute": 1,
    }


def test_a_sequence_axis_that_does_not_divide_the_devices_is_refused(capsys):
    with pytest.raises(SystemExit) as stopped:
        scale.main(["--devices", "8", "--sequence-parallel", "3"])
    assert stopped.value.code == 2
    assert "--sequence-parallel (3) must be a positive divisor of --devices (8)" in (
        capsys.readouterr().err
    )


def test_an_abstract_batch_as_the_plan_builds_it_is_accepted():
    """`bench.scale` builds its step from `jax.ShapeDtypeStruct`s: the batch's checks that
    read values (times running down) leave abstract fields alone. (The suite's runtime type
    checker, which wants arrays, is off for the construction, as it is in `bench.scale`.)"""
    import jax
    import jax.numpy as jnp
    import jaxtyping

    def abstract(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        batch = make(abstract)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    assert batch.timesteps.shape == (4, 1)


def make(abstract):
    import jax.numpy as jnp

    import flowgrpo_eqx as fg

    return fg.Transitions(
        latents=abstract(4, 1, 8),
        next_latents=abstract(4, 1, 8),
        timesteps=abstract(4, 1),
        next_timesteps=abstract(4, 1),
        old_log_probs=abstract(4, 1),
        transition_mask=abstract(4, 1, dtype=jnp.bool_),
        advantages=abstract(4),
        cond=abstract(4, 3),
    )


def test_the_largest_all_reduces_are_named_by_shape_and_size():
    hlo = """
  %all-reduce.7 = f32[23,1536,6144]{2,1,0} all-reduce(f32[23,1536,6144]{2,1,0} %s), to_apply=%a
  %all-reduce-start.2 = bf16[64]{0} all-reduce-start(bf16[64]{0} %t), to_apply=%a
  %all-reduce.9 = f32[]{} all-reduce(f32[] %u), to_apply=%a
"""
    assert scale.largest_reductions(hlo, count=2) == [
        "f32[23, 1536, 6144] = 0.868 GB",
        "bf16[64] = 0.000 GB",
    ]
