"""`tools.tpu.splash_blocks`: each variant of the splash kernel's block sizes, swapped into
the library's `splash_attention`, computes the float64 statement of attention
(`numpy_reference.attention`) in values and gradients (in Pallas's interpreter, as on the
CPU the library's own kernel is: `tests/test_fused_attention.py`), the swap is undone, the
command line names a bad argument before it measures anything, and a record of a sweep is
drawn."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from flowgrpo_eqx.models import _splash
from tests.tiny_models import assert_attention_statement
from tests.tolerances import attention_tolerance
from tools.tpu import splash_blocks
from tools.tpu.splash_blocks import VARIANTS, Blocks, kernel_blocks


BEYOND_THE_CHIPS_VMEM = {"pad1408_whole", "whole"}
"""The variants whose float32 forward needs more of a TPU v5e's scoped VMEM (16 MiB) than it
has (27.94 MiB at 200 tokens, padded to a whole block; the bfloat16 sweep's record says the
same at SD3.5's shape): compiled for that chip, they fail there, and only there (a chip with
more VMEM is held to computing them)."""


def _variant(name):
    on_v5e = jax.default_backend() == "tpu" and jax.devices()[0].device_kind == "TPU v5 lite"
    beyond = pytest.mark.xfail(
        on_v5e and name in BEYOND_THE_CHIPS_VMEM,
        reason="more scoped VMEM than a TPU v5e has",
        raises=jax.errors.JaxRuntimeError,
        strict=True,
    )
    return pytest.param(name, marks=beyond)


@pytest.mark.parametrize("name", [_variant(name) for name in VARIANTS if name != "library"])
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


def _record(tmp_path, variants):
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"device": "TPU v5 lite", "shape": [8, 1357, 24, 64], **variants}))
    return str(path)


def test_a_record_is_drawn_with_every_variant_failed_ones_too(tmp_path):
    times = {"median": 3.9, "p25": 3.8, "p75": 4.0, "rounds": 20}
    record = _record(
        tmp_path,
        {
            "variants": {
                "library": {"forward_ms": times, "gradient_ms": times},
                "whole": {"error": "RESOURCE_EXHAUSTED"},
            }
        },
    )
    picture = tmp_path / "sweep.png"
    assert splash_blocks.main(["--from-record", record, "--plot", str(picture)]) == 0
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.width == 800


@pytest.mark.parametrize(
    ("variants", "argv_tail"),
    [
        ({"variants": {"library": {"forward_ms": None}}}, ["--plot", "x.png"]),
        ({"rows": []}, ["--plot", "x.png"]),
        ({"variants": {}}, []),
    ],
)
def test_a_record_that_cannot_be_drawn_is_named(variants, argv_tail, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        splash_blocks.main(["--from-record", _record(tmp_path, variants), *argv_tail])
    assert stopped.value.code == 2
    assert "--from-record" in capsys.readouterr().err
