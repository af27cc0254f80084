"""`SplashAttention` and `AutoAttention`: Pallas's splash attention kernel against the float64
statement (`numpy_reference.attention`), in values and gradients, and every model's velocity
and gradient with it (docs/accelerators.md).

On a TPU the kernel is compiled by Mosaic; on a CPU the same kernel program runs in Pallas's
interpreter, so CI checks the same computation the TPU runs, only slower. Which one ran is
asserted on the compiled program (`test_auto_attention_is_the_platforms_fastest`).
"""

import functools
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import (
    AbstractAttention,
    AutoAttention,
    ChunkedAttention,
    DiT,
    MMDiT,
    Remat,
    SaveAttention,
    SaveQKV,
    SplashAttention,
    _splash,
    attention_from_name,
    load_diffusers,
)
from flowgrpo_eqx.models._layers import local_attention
from tests.diffusers_helpers import (
    assert_leaves_close,
    relative,
    vcall,
    velocity_and_sin_gradient,
)
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tiny_models import assert_attention_statement, dit_batch_of_two, perturbed
from tests.tolerances import attention_tolerance, reference_model_rtol


DATA = pathlib.Path(__file__).resolve().parent / "data"


@functools.partial(jax.jit, static_argnames="attention")
def _attention_and_vjp(q: Any, k: Any, v: Any, d_out: Any, attention: AbstractAttention) -> Any:
    """A batch of two examples' attention and the gradient of `sum(out * d_out)`, as the
    models run it (one example's function, vmapped)."""

    def value(q: Any, k: Any, v: Any) -> Any:
        out = jax.vmap(lambda q, k, v: local_attention(q, k, v, attention))(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    (_, out), grads = jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@pytest.mark.parametrize(
    ("queries", "keys", "heads", "head_dim", "block", "dtype"),
    [
        (256, 256, 2, 64, 128, "float32"),  # two blocks of queries, no padding
        (200, 200, 3, 64, 128, "float32"),  # padded queries and masked padded keys
        (130, 77, 2, 32, 256, "float32"),  # a cross-attention, shorter than one block
        (130, 3000, 2, 32, 256, "float32"),  # keys in two blocks of 1,536, scored 256 at a time
        (200, 200, 2, 64, 128, "bfloat16"),
    ],
)
def test_splash_attention_matches_the_float64_statement_in_values_and_gradients(
    queries: int, keys: int, heads: int, head_dim: int, block: int, dtype: str
) -> None:
    rng = np.random.default_rng(queries + keys)
    q = rng.standard_normal((2, queries, heads, head_dim))
    k = rng.standard_normal((2, keys, heads, head_dim))
    v = rng.standard_normal((2, keys, heads, head_dim))
    d_out = rng.standard_normal((2, queries, heads, head_dim))
    cast = [jnp.asarray(a, dtype) for a in (q, k, v)]
    # The statement is evaluated at the inputs as the kernel sees them (rounded to `dtype`).
    q, k, v = (np.asarray(a, np.float64) for a in cast)
    attention = SplashAttention(block)
    out, grads = _attention_and_vjp(*cast, jnp.asarray(d_out, jnp.float32), attention)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (2, queries, heads, head_dim)
    tolerance = attention_tolerance(dtype)
    for row in range(2):
        row_grads = [g[row] for g in grads]
        assert_attention_statement(
            out[row], row_grads, q[row], k[row], v[row], d_out[row], tolerance
        )


@pytest.mark.parametrize(
    ("queries", "keys", "block", "want"),
    [
        # SD3.5-Medium at 512²: the joint attention and the image's own.
        (1357, 1357, 512, (512, 1536, 1536, 1536)),
        (1024, 1024, 512, (512, 1024, 1024, 1024)),
        # FLUX at 1024² (4,608 tokens): 1,536 keys a block, the most that is read at once.
        (4608, 4608, 512, (512, 1536, 4608, 4608)),
        # Wan's 14,040 tokens, padded to 28 blocks of 512: 1,024 keys a block (28 = 2 * 14).
        (14040, 14040, 512, (512, 1024, 14336, 14336)),
        # Thirteen blocks of 512 keys (a prime count): read one at a time, as they are scored.
        (6600, 6600, 512, (512, 512, 6656, 6656)),
        # Shorter than one block: one block of the length rounded up to 128.
        (200, 77, 512, (256, 128, 256, 128)),
    ],
)
def test_the_kernel_reads_keys_in_few_blocks_scored_one_block_at_a_time(
    queries: int, keys: int, block: int, want: tuple[int, int, int, int]
) -> None:
    _, sizes, padded_q, padded_kv = _splash._mask(queries, keys, 2, block)
    assert (sizes.block_q, sizes.block_kv, padded_q, padded_kv) == want
    assert sizes.k_layout.name == "SEQ_MINOR"
    assert sizes.q_layout.name == sizes.v_layout.name == "HEAD_DIM_MINOR"
    assert sizes.block_q_dkv == sizes.block_q and sizes.block_kv_dkv == sizes.block_kv
    scored = min(block, -(-keys // 128) * 128)
    assert sizes.block_kv_compute == sizes.block_kv_dkv_compute == scored
    assert sizes.block_kv % scored == 0 and padded_kv % sizes.block_kv == 0
    assert sizes.block_kv <= max(_splash.KEY_BLOCK_LIMIT, scored)


def test_a_splash_block_that_is_not_a_multiple_of_128_is_named() -> None:
    for kind in (SplashAttention, AutoAttention):
        with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`block`.*multiple of 128"):
            kind(100)
    for name in ("splash", "auto"):
        with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`attention_chunk`.*multiple of 128"):
            attention_from_name(name, 64)
    # Chunked attention keeps any chunk.
    assert ChunkedAttention(100).chunk == 100
    assert attention_from_name("chunked", 100) == ChunkedAttention(100)


def _fixture(name: str) -> tuple[Any, dict[str, np.ndarray], tuple[Any, ...]]:
    """A tiny diffusers-made model of `tests/data`, its inputs and diffusers' output."""
    io = dict(np.load(DATA / name / "io.npz"))
    if name == "wan_tiny":
        model = load_diffusers(DATA / name, image_size=(3, 4, 6), context_length=5)
        return model, io, (io["x"], io["t"], io["context"])
    if name == "flux_tiny":
        model = load_diffusers(DATA / name, image_size=(8, 6), context_length=5)
        cond = {"context": io["context"], "pooled": io["pooled"], "guidance": io["guidance"]}
        return model, io, (io["x"], io["t"], cond)
    model = load_diffusers(DATA / name, context_length=5)
    return model, io, (io["x"], io["t"], {"context": io["context"], "pooled": io["pooled"]})


@pytest.mark.parametrize("attention", ["splash", "auto"])
@pytest.mark.parametrize("name", ["sd35_tiny", "flux_tiny", "wan_tiny"])
def test_every_diffusers_model_computes_diffusers_velocity_with_fused_attention(
    name: str, attention: str
) -> None:
    model, io, inputs = _fixture(name)
    fused = model.with_settings(attention=attention_from_name(attention, 128))
    assert fused.attention == attention_from_name(attention, 128)
    # The same function as diffusers' (the authority).
    assert relative(np.asarray(vcall(fused, *inputs)), io["v"]) < reference_model_rtol()
    # And the same gradient as plain attention's on moved weights.
    moved = perturbed(model, seed=3)
    _, want = velocity_and_sin_gradient(moved, *inputs)
    _, got = velocity_and_sin_gradient(
        moved.with_settings(attention=attention_from_name(attention, 128)), *inputs
    )
    assert_leaves_close(got, want, attention_tolerance("float32"))


@pytest.mark.parametrize("remat", [SaveQKV(), SaveAttention()])
def test_dit_with_splash_attention_and_named_remat_computes_the_same(remat: Remat) -> None:
    plain = perturbed(
        DiT(image_size=8, width=32, depth=2, heads=2, stacked=True, key=jax.random.key(0)), 5
    )
    x, t, cond = dit_batch_of_two(0)
    want_v, want_g = velocity_and_sin_gradient(plain, x, t, cond)
    fused = plain.with_settings(attention=SplashAttention(128), remat=remat)
    got_v, got_g = velocity_and_sin_gradient(fused, x, t, cond)
    scale = float(np.max(np.abs(np.asarray(want_v))))
    tolerance = attention_tolerance("float32")
    np.testing.assert_allclose(np.asarray(got_v), want_v, rtol=0, atol=tolerance * scale)
    assert_leaves_close(got_g, want_g, tolerance)


def test_auto_attention_is_the_platforms_fastest() -> None:
    """Lowered for a TPU, `AutoAttention` is the splash kernel (a Mosaic custom call); for a
    CPU, the plain form (no kernel, no interpreter)."""
    model = MMDiT(
        image_size=8, channels=4, patch=2, width=32, depth=1, heads=2, context_length=3,
        context_dim=12, pooled_dim=10, attention=AutoAttention(), key=jax.random.key(0),
    )  # fmt: skip
    x = jnp.zeros((8, 8, 4))
    cond = {"context": jnp.zeros((3, 12)), "pooled": jnp.zeros((10,))}
    params, static = eqx.partition(model, eqx.is_array)
    call = jax.jit(lambda params, *args: eqx.combine(params, static)(*args))
    text = call.lower(params, x, jnp.float32(0.5), cond).compile().as_text()
    if jax.default_backend() == "tpu":
        assert "tpu_custom_call" in text
    else:
        assert "tpu_custom_call" not in text and "callback" not in text


def test_splash_on_a_mesh_of_several_devices_is_refused_and_auto_takes_the_plain_form():
    """A Mosaic kernel cannot be partitioned by XLA, nor (splash's) called inside a
    `shard_map`: on a mesh of several devices `"splash"` is refused by name, `"auto"` is
    plain."""
    q = jnp.ones((2, 200, 2, 64), jnp.float32)
    mesh = jax.sharding.AbstractMesh((2,), ("data",))

    def attend(attention: AbstractAttention) -> Any:
        return jax.make_jaxpr(jax.vmap(lambda q: local_attention(q, q, q, attention)))(q)

    with jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"`attention`=SplashAttention cannot run on a mesh of several devices"
        ):
            attend(SplashAttention(128))
        assert "pallas_call" not in str(attend(AutoAttention(128)))
    assert "pallas_call" in str(attend(AutoAttention(128)))
