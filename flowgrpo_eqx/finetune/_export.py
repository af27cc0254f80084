"""A trained policy out to diffusers: the LoRA adapters as `load_lora_weights` reads them,
and the transformer (the adapters merged) as a diffusers folder."""

import pathlib
from typing import Any

import jax.numpy as jnp

from .. import lora
from ..models import save_diffusers, save_diffusers_lora


def export_policy(policy: Any, folder: pathlib.Path, *, dtype: str) -> list[pathlib.Path]:
    """Write `folder/lora` (a LoRA policy's adapters: `pytorch_lora_weights.safetensors`) and
    `folder/transformer` (the merged transformer, `config.json` and its weights in `dtype`).

    **Arguments:**

    - `policy`: the trained policy: a `LoraModel` of an `MMDiT`, `Flux` or `Wan`, or one of
        those (every weight trained).
    - `folder`: where the two folders go.
    - `dtype`: the merged transformer's weights' dtype, `"bfloat16"` or `"float32"`.

    **Returns:**

    The folders written.
    """
    written = []
    model = policy
    if lora.has_adapters(policy):
        save_diffusers_lora(folder / "lora", policy)
        written.append(folder / "lora")
        model = lora.merge(policy)
    save_diffusers(
        folder / "transformer",
        model,
        dtype=jnp.bfloat16 if dtype == "bfloat16" else jnp.float32,
    )
    written.append(folder / "transformer")
    return written
