"""A tiny SD3.5-shaped MMDiT that the tests of the query-key norm share, and a batch of two
inputs for it."""

from typing import Any

import numpy as np


SD35_SHAPED: dict[str, Any] = dict(
    image_size=8,
    channels=4,
    patch=2,
    depth=2,
    width=32,
    heads=2,
    context_length=3,
    context_dim=12,
    pooled_dim=10,
    qk_norm="rms_norm",
    dual_attention_layers=(0,),
)
"""Two blocks of width 32 with two 16-wide heads, the query-key norm on, and a second
attention in block 0 (`MMDiT`'s arguments but `key`)."""


def batch_of_two(seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Latents, times and text conditioning of two examples for `SD35_SHAPED`, in float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 8, 4)).astype(np.float32)
    t = rng.uniform(size=(2,)).astype(np.float32)
    cond = {
        "context": rng.standard_normal((2, 3, 12)).astype(np.float32),
        "pooled": rng.standard_normal((2, 10)).astype(np.float32),
    }
    return x, t, cond
