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
