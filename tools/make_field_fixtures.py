"""Tiny diffusers transformers whose configuration fields are not the published defaults.

`load_diffusers` takes every field of diffusers' `SD3Transformer2DModel`,
`FluxTransformer2DModel` and `WanTransformer3DModel` that our models can compute; these
fixtures are one model of each class built by diffusers with such fields set away from the
published values, so `tests/test_diffusers_fields.py` can check that the loader reads them and
computes what diffusers computes. As the other fixture scripts (read
`tools/make_sd3_fixtures.py` for the environment), this runs by hand in a venv with torch and
diffusers (diffusers 0.42.1, torch 2.13.0 CPU):

    /tmp/venv-torch/bin/python tools/make_field_fixtures.py

It writes `tests/data/fields/<name>/` (`config.json`, the weights, and `io.npz`: inputs in
our conventions and diffusers' output for them, run as the pipelines run each model):

- `wan`: `freq_dim` 32, `eps` 1e-5, `cross_attn_norm` false (no norm before the
    cross-attention, and no `norm2` weights), `qk_norm` "rms_norm" (diffusers' Wan attention
    reads no `qk_norm`: it RMS-normalises queries and keys whatever the field says),
    `rope_max_seq_len` 16;
- `flux`: `patch_size` 2 with `out_channels` a quarter of `in_channels` (diffusers embeds
    each packed token whole and projects it back to `patch_size**2 * out_channels` values),
    no guidance embedding, other rotary widths;
- `sd3`: `patch_size` 1, three heads of 8, `pos_embed_max_size` 10 over a 6 x 6 latent, a
    dual-attention second block and RMS qk-norm.
"""

import json
import pathlib
import sys

import make_flux_wan_fixtures as flux_wan
import make_sd3_fixtures as sd3


FIELDS = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "fields"
WAN_LATENT = (2, 4, 6, 4)
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=WAN_LATENT[3],
    out_channels=WAN_LATENT[3],
    text_dim=10,
    freq_dim=32,
    ffn_dim=16,
    num_layers=2,
    cross_attn_norm=False,
    qk_norm="rms_norm",
    eps=1e-5,
    rope_max_seq_len=16,
)
FLUX_LATENT = (4, 6, 3)
FLUX = dict(
    patch_size=2,
    in_channels=4 * FLUX_LATENT[2],
    out_channels=FLUX_LATENT[2],
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=12,
    num_attention_heads=2,
    joint_attention_dim=9,
    pooled_projection_dim=7,
    guidance_embeds=False,
    axes_dims_rope=(4, 4, 4),
)
SD3 = dict(
    sample_size=6,
    patch_size=1,
    in_channels=3,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=3,
    joint_attention_dim=10,
    caption_projection_dim=24,
    pooled_projection_dim=7,
    out_channels=3,
    pos_embed_max_size=10,
    dual_attention_layers=(1,),
    qk_norm="rms_norm",
)


def _randomise(model: object) -> None:
    import torch

    with torch.no_grad():
        for param in model.parameters():  # type: ignore[attr-defined]
            # Away from 0 and 1 (norm weights start at 1, nothing else may sit at 0).
            param.copy_(0.3 * torch.randn_like(param) + 0.05)


def make() -> None:
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    batch, length = flux_wan.BATCH, flux_wan.CONTEXT_LENGTH

    def save(name: str, model: object, inputs: dict[str, object], v: object) -> None:
        folder = FIELDS / name
        model.save_pretrained(folder, safe_serialization=True)  # type: ignore[attr-defined]
        np.savez(folder / "io.npz", **inputs, v=v)
        print(name, json.dumps({k: str(v) for k, v in model.config.items()})[:200])  # type: ignore[attr-defined]

    wan = WanTransformer3DModel(**WAN).eval()
    _randomise(wan)
    inputs = {
        "x": rng.standard_normal((batch, *WAN_LATENT)),
        "t": np.asarray([0.9, 0.27]),
        "context": rng.standard_normal((batch, length, WAN["text_dim"])),
    }
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    save("wan", wan, inputs, flux_wan._wan_velocity(wan, inputs))

    flux = FluxTransformer2DModel(**FLUX).eval()
    _randomise(flux)
    inputs = {
        "x": rng.standard_normal((batch, *FLUX_LATENT)),
        "t": np.asarray([0.9, 0.27]),
        "context": rng.standard_normal((batch, length, FLUX["joint_attention_dim"])),
        "pooled": rng.standard_normal((batch, FLUX["pooled_projection_dim"])),
    }
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    save("flux", flux, inputs, flux_wan._diffusers_velocity(flux, inputs))

    mmdit = SD3Transformer2DModel(**SD3).eval()
    _randomise(mmdit)
    size = SD3["sample_size"]
    inputs = {
        "x": rng.standard_normal((batch, size, size, SD3["in_channels"])),
        "t": np.asarray([0.9, 0.27]),
        "context": rng.standard_normal((batch, length, SD3["joint_attention_dim"])),
        "pooled": rng.standard_normal((batch, SD3["pooled_projection_dim"])),
    }
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    save("sd3", mmdit, inputs, sd3._diffusers_velocity(mmdit, inputs))


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_field_fixtures.py (no arguments)")
    make()
