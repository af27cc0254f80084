"""What `remat=SaveDots()` saves for the backward pass: the products with a weight matrix, and
nothing that the query-key norm adds (`head_rms_norm` computes each head's statistics with
products of its own, which JAX's `dots_with_no_batch_dims_saveable` would keep: `[S, width]`
in float32 per norm, which took SD3.5-Medium's LoRA step at batch 8 over a TPU v5e's memory)."""

import collections
import contextlib
import io
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from flowgrpo_eqx.models import DiT, MMDiT, SaveDots, SaveNothing
from tests.tiny_models import SD35_SHAPED, batch_of_two, dit_batch_of_two


_RESIDUAL = re.compile(r"^(\w+\[[\d,]*\]) (.*)$")

SIZES = {**SD35_SHAPED, "remat": SaveDots()}


def _saved(model: Any, batch: Any = None) -> collections.Counter[str]:
    """The types (`f32[2,16,32]`) of what the value-and-gradient of a batch of two
    (`batch_of_two`'s unless given) keeps for its backward pass, each with its count, the
    arguments left out."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, t, cond = batch_of_two(0) if batch is None else batch

    def value(params: Any) -> jax.Array:
        return jnp.sum(jnp.sin(jax.vmap(eqx.combine(params, static))(x, t, cond)))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(value, params)
    saved: collections.Counter[str] = collections.Counter()
    for line in printed.getvalue().splitlines():
        match = _RESIDUAL.match(line)
        assert match is not None, line
        if not match.group(2).startswith("from the argument"):
            saved[match.group(1)] += 1
    return saved


@pytest.mark.parametrize("stacked", [True, False])
def test_dots_saves_nothing_for_the_query_key_norm(stacked: bool) -> None:
    with_norm = _saved(MMDiT(**SIZES, stacked=stacked, key=jax.random.key(0)))
    without = _saved(MMDiT(**{**SIZES, "qk_norm": None}, stacked=stacked, key=jax.random.key(0)))
    assert with_norm == without


def test_dots_saves_the_weight_products_and_nothing_saves_none_of_them() -> None:
    dots = _saved(MMDiT(**SIZES, stacked=False, key=jax.random.key(0)))
    # Each block's image queries, keys and values, `[2 rows, 16 tokens, 32]`, three per
    # attention: the joint one in both blocks and block 0's second attention.
    assert dots["f32[2,16,32]"] >= 3 * 3
    nothing = _saved(
        MMDiT(**{**SIZES, "remat": SaveNothing()}, stacked=False, key=jax.random.key(0))
    )
    assert nothing["f32[2,16,32]"] < dots["f32[2,16,32]"]


@pytest.mark.parametrize("stacked", [True, False])
def test_a_remat_per_block_saves_the_products_of_the_blocks_it_names(stacked: bool) -> None:
    # Per block of the DiT (16 image and 4 prompt tokens, width 32), `SaveDots()` saves the
    # feed-forward's hidden products, `[2, 20, 128]`, and the stacked queries, keys and
    # values, `[2, 3, 2, 20, 16]`; `SaveNothing()` saves neither. Stacked, the k blocks of the
    # first run save them k-deep.
    sizes = dict(image_size=8, patch=2, width=32, depth=4, heads=2, vocab_size=5, stacked=stacked)
    batch = dit_batch_of_two(0, vocab_size=5)
    products = ("2,20,128", "2,3,2,20,16")
    for k in range(5):
        remat = (SaveDots(),) * k + (SaveNothing(),) * (4 - k)
        saved = _saved(DiT(**sizes, remat=remat, key=jax.random.key(0)), batch)
        for shape in products:
            if stacked:
                deep = {depth: saved[f"f32[{depth},{shape}]"] for depth in range(1, 5)}
                assert deep == {depth: int(depth == k) for depth in range(1, 5)}, (k, saved)
            else:
                assert saved[f"f32[{shape}]"] == k, (k, saved)
