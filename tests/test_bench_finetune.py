"""`bench/finetune.py`: each row is a configuration the trainer reads, and the model FLOPs it
divides by are counted exactly."""

import pathlib
import tempfile

import jax
import jax.numpy as jnp
import pytest

from bench.finetune import ROWS, _conv_flops, _flops, _write, per_sample_flops
from flowgrpo_eqx.finetune import read_config


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_row_is_a_configuration_of_its_published_size(
    tmp_path: pathlib.Path, name: str
) -> None:
    row = ROWS[name]
    _write(row.table(tmp_path), tmp_path / "config.toml")
    config = read_config(tmp_path / "config.toml").resolved()
    assert config.pipeline.random_weights == row.random_weights
    assert config.image_size() == (row.height, row.width)
    flops = per_sample_flops(config)
    assert all(value > 0 for value in flops.values())


def test_a_convolution_and_a_matmul_count_as_written() -> None:
    """2 x output elements x input channels x kernel size, and 2 x m x n x k."""
    image = jax.ShapeDtypeStruct((1, 10, 12, 3), jnp.float32)
    kernel = jax.ShapeDtypeStruct((5, 3, 3, 3), jnp.float32)

    def conv(x: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "OIHW", "NHWC")
        )

    jaxpr = jax.make_jaxpr(conv)(image, kernel).jaxpr
    assert _conv_flops(jaxpr) == 2 * (10 * 12 * 5) * 3 * 9
    a = jax.ShapeDtypeStruct((4, 6), jnp.float32)
    b = jax.ShapeDtypeStruct((6, 7), jnp.float32)
    assert _flops(lambda x, y: x @ y, a, b) == 2 * 4 * 6 * 7


def test_sd35_mediums_call_counts_its_blocks_matmuls() -> None:
    """At 512 x 512 with 128 T5 tokens: 1024 image and 205 text tokens through 24 joint blocks
    of width 1536 (per stream and token: q, k, v, the output and a 4x MLP, 12 x 1536^2
    multiply-adds), the 13 dual-attention blocks' second attention on the image tokens
    (4 x 1536^2), and the attention products of both; the embeddings and the final layer are
    a few percent more."""
    row = ROWS["sd35m-512-lora32-pickscore"]
    with tempfile.TemporaryDirectory() as name:
        path = pathlib.Path(name)
        _write(row.table(path), path / "c.toml")
        config = read_config(path / "c.toml").resolved()
    flops = per_sample_flops(config)["transformer"]
    width, image, text = 1536, 1024, 77 + 128
    blocks = 24 * 2 * 12 * width**2 * (image + text)
    dual = 13 * 2 * 4 * width**2 * image
    attention = 24 * 2 * 2 * (image + text) ** 2 * width + 13 * 2 * 2 * image**2 * width
    assert flops == pytest.approx(blocks + dual + attention, rel=0.05)
