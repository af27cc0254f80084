"""`tools.tpu.splash_step`: each variant's blocks, swapped into the library's
`splash_attention`, compute the float64 statement of attention (`numpy_reference.attention`)
in values and gradients (in Pallas's interpreter, as on the CPU the library's own kernel is:
`tests/test_fused_attention.py`) with the keys read in blocks of the variant's size, the swap
is undone, and the command measures the variants it names (its bad arguments:
`tests/test_norm_variants.py`, with the other whole-step experiments')."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import _splash
from tests.tiny_models import assert_attention_statement
from tests.tolerances import attention_tolerance
from tools.tpu import splash_step
from tools.tpu.splash_step import VARIANTS, key_blocks


@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "library"])
def test_each_variant_reads_its_key_blocks_and_computes_attention(name):
    rng = np.random.default_rng(11)
    q, k, v, d_out = (rng.standard_normal((300, 2, 64)) for _ in range(4))
    library_mask = _splash._mask
    with key_blocks(VARIANTS[name]):
        assert _splash._mask is not library_mask
        _, sizes, padded_q, padded_kv = _splash._mask(300, 300, 2, 128)
        out, pullback = jax.vjp(
            lambda q, k, v: _splash.splash_attention(q, k, v, block=128),
            *(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
        )
        grads = pullback(jnp.asarray(d_out, jnp.float32))
    assert _splash._mask is library_mask
    assert (padded_q, padded_kv) == _splash._mask(300, 300, 2, 128)[2:] == (384, 384)
    read = {"by_block": 128, "whole": 384, "head_dim_minor": 384}[VARIANTS[name]]
    assert (sizes.block_kv, sizes.block_kv_dkv) == (read, read)
    head_dim_minor = VARIANTS[name] == "head_dim_minor"
    assert sizes.k_layout.name == ("HEAD_DIM_MINOR" if head_dim_minor else "SEQ_MINOR")
    assert (sizes.block_q, sizes.block_q_dkv) == (128, 128)
    assert (sizes.block_kv_compute, sizes.block_kv_dkv_compute) == (128, 128)
    assert_attention_statement(out, grads, q, k, v, d_out, attention_tolerance("float32"))


def test_the_command_measures_the_variants_named_in_their_order(monkeypatch, capsys):
    from bench import _full_size as full_size

    measured = []

    def measure(row, calls, _, peak, folder):
        measured.append((row.name, calls, _splash._mask))
        return {"ms": 1.0}

    monkeypatch.setattr(full_size, "measure", measure)
    monkeypatch.setattr(full_size, "device_peak_tflops", lambda device: 197.0)
    library_mask = _splash._mask
    argv = ["--variants", "keys_by_block,library", "--calls", "2"]
    assert splash_step.main(argv) == 0
    assert [(name, calls) for name, calls, _ in measured] == [("sd35m b8 splash nothing", 2)] * 2
    assert measured[0][2] is not library_mask and measured[1][2] is library_mask
    assert _splash._mask is library_mask
    report = json.loads(capsys.readouterr().out)
    assert list(report)[2:] == ["keys_by_block", "library"]
