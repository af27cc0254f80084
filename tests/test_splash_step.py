"""`tools.tpu.splash_step`: each variant's blocks, swapped into the library's
`splash_attention`, compute the float64 statement of attention (`numpy_reference.attention`)
in values and gradients (in Pallas's interpreter, as on the CPU the library's own kernel is:
`tests/test_fused_attention.py`) with the keys (and the queries) in one block, the swap is
undone, and the command line names a bad argument before it measures anything."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import _splash
from tests.tiny_models import assert_attention_statement
from tests.tolerances import attention_tolerance
from tools.tpu import splash_step
from tools.tpu.splash_step import VARIANTS, one_block


@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "library"])
def test_each_variant_reads_whole_rows_and_computes_attention(name):
    rng = np.random.default_rng(11)
    q, k, v, d_out = (rng.standard_normal((300, 2, 64)) for _ in range(4))
    library_mask = _splash._mask
    with one_block(VARIANTS[name]):
        assert _splash._mask is not library_mask
        _, sizes, padded_q, padded_kv = _splash._mask(300, 300, 2, 128)
        out, pullback = jax.vjp(
            lambda q, k, v: _splash.splash_attention(q, k, v, block=128),
            *(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
        )
        grads = pullback(jnp.asarray(d_out, jnp.float32))
    assert _splash._mask is library_mask
    assert (padded_q, padded_kv) == _splash._mask(300, 300, 2, 128)[2:] == (384, 384)
    assert (sizes.block_kv, sizes.block_kv_dkv) == (384, 384)
    assert (sizes.block_kv_compute, sizes.block_kv_dkv_compute) == (128, 128)
    queries_block = 384 if VARIANTS[name] else 128
    assert (sizes.block_q, sizes.block_q_dkv) == (queries_block, queries_block)
    assert_attention_statement(out, grads, q, k, v, d_out, attention_tolerance("float32"))


@pytest.mark.parametrize(
    ("argv", "named"), [(["--calls", "0"], "--calls"), (["--row", "nonsense"], "--row")]
)
def test_the_command_names_a_bad_argument_before_measuring(argv, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        splash_step.main(argv)
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
