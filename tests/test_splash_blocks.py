"""`tools.tpu.splash_blocks`: each variant of the splash kernel's block sizes, swapped into
the library's `splash_attention`, computes the float64 statement of attention
(`numpy_reference.attention`) in values and gradients (in Pallas's interpreter, as on the
CPU the library's own kernel is: `tests/test_fused_attention.py`), the swap is undone, and
the command line names a bad argument before it measures anything."""

import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import _splash
from tests.tiny_models import assert_attention_statement
from tests.tolerances import attention_tolerance
from tools.tpu import splash_blocks
from tools.tpu.splash_blocks import VARIANTS, Blocks, kernel_blocks


@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "library"])
def test_each_variant_computes_attention_and_its_gradient(name):
    rng = np.random.default_rng(7)
    q, k, v, d_out = (rng.standard_normal((1, 200, 2, 64)) for _ in range(4))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    library_mask = _splash._mask
    with kernel_blocks(VARIANTS[name]):
        assert _splash._mask is not library_mask
        forward, gradient = splash_blocks._programs(block=512)
        out = forward(*args)
        _, grads = gradient(*args, jnp.asarray(d_out, jnp.float32))
        padded = _splash._mask(200, 200, 2, 512)[2:]
    assert _splash._mask is library_mask
    blocks = VARIANTS[name]
    assert padded[0] % blocks.q == 0 and padded[0] % blocks.q_dkv == 0 and padded[0] >= 200
    assert padded[1] % blocks.kv == 0 and padded[1] % blocks.kv_dkv_compute == 0
    row_grads = [g[0] for g in grads]
    tolerance = attention_tolerance("float32")
    assert_attention_statement(out[0], row_grads, q[0], k[0], v[0], d_out[0], tolerance)


def test_the_padded_length_is_a_multiple_of_every_block_and_of_pad_to():
    blocks = Blocks(512, 512, 512, 1024, 1024, 512, pad_to=1024)
    assert blocks.padded(1357, (blocks.q, blocks.q_dkv)) == 2048
    assert Blocks(1408, 1408, 1408, 1408, 1408, 1408).padded(1357, (1408,)) == 1408
    assert Blocks(256, 1536, 512, 256, 1536, 512).padded(1357, (256, 256)) == 1536


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--rounds", "0"], "--rounds"),
        (["--shape", "8,1357,24"], "--shape"),
        (["--shape", "8,0,24,64"], "--shape"),
        (["--variants", "library,nonsense"], "--variants"),
    ],
)
def test_the_command_names_a_bad_argument_before_measuring(argv, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        splash_blocks.main(argv)
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
