"""Fixtures for `AutoencoderKL` and diffusers' `vae/` format, made with diffusers itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch and diffusers (diffusers 0.42.1, torch 2.13.0 CPU); the library
and its tests never import torch:

    /tmp/venv-torch/bin/python tools/make_vae_fixtures.py

It writes into `tests/data/`:

- `vae_tiny/`: a tiny random `AutoencoderKL` with SD3's structure (two levels, GroupNorms of
    4 groups, the mid-blocks' attention, no quant convolutions, a scaling and a shift
    factor), with `io.npz`: channels-last images in `[-1, 1]` (`image`, non-square), a noise
    draw (`noise`), and diffusers' posterior mean and log-variance (`mean`, `logvar`:
    `vae.encode(image).latent_dist`), the latent the SD3 pipelines train on for the mean and
    for the sample `mean + std * noise` (`latent`, `sampled`: `(z - shift) * scale`), and the
    decoded images of `latent` as `StableDiffusion3Pipeline` decodes them (`decoded`:
    `vae.decode(latent / scale + shift)`);
- `vae_tiny_quant/`: the same with `use_quant_conv` and `use_post_quant_conv` (SD1/SDXL's
    layout) and no mid-block attention, with `io.npz` alike;
- `vae_keys.json`: every key of SD3.5's and FLUX.1's VAE state dicts with its shape, and their
    parameter counts, built on torch's 'meta' device from their published `config.json`.
"""

import json
import pathlib
import sys
from typing import Any


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
TINY = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 16],
    layers_per_block=1,
    act_fn="silu",
    latent_channels=4,
    norm_num_groups=4,
    sample_size=16,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)
TINY_QUANT = dict(
    TINY, use_quant_conv=True, use_post_quant_conv=True, mid_block_add_attention=False
)
# stabilityai/stable-diffusion-3.5-medium, vae/config.json.
SD35 = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# black-forest-labs/FLUX.1-dev, vae/config.json.
FLUX = dict(SD35, scaling_factor=0.3611, shift_factor=0.1159)


def _tiny(name: str, config: dict[str, Any]) -> None:
    import numpy as np
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = AutoencoderKL(**config).eval()
    with torch.no_grad():
        for param in model.parameters():
            # Away from 0 and 1 (norm weights start at 1, nothing else may sit at 0).
            param.copy_(0.2 * torch.randn_like(param) + 0.02)
    folder = DATA / name
    model.save_pretrained(folder, safe_serialization=True)
    image = rng.uniform(-1.0, 1.0, (2, 16, 24, 3)).astype(np.float32)
    scale, shift = config["scaling_factor"], config["shift_factor"]
    with torch.no_grad():
        posterior = model.encode(torch.from_numpy(image).permute(0, 3, 1, 2)).latent_dist
        mean, logvar = posterior.mean, posterior.logvar
        noise = torch.from_numpy(rng.standard_normal(tuple(mean.shape)).astype(np.float32))
        sampled = mean + posterior.std * noise
        latent = (mean - shift) * scale
        decoded = model.decode(latent / scale + shift).sample

    def last(x: Any) -> Any:
        return x.permute(0, 2, 3, 1).numpy()

    np.savez(
        folder / "io.npz",
        image=image,
        noise=last(noise),
        mean=last(mean),
        logvar=last(logvar),
        latent=last(latent),
        sampled=last((sampled - shift) * scale),
        decoded=last(decoded),
    )
    print(name, "latent", last(latent).shape, "decoded", float(np.abs(last(decoded)).mean()))


def make() -> None:
    import torch
    from diffusers import AutoencoderKL

    _tiny("vae_tiny", TINY)
    _tiny("vae_tiny_quant", TINY_QUANT)
    record: dict[str, Any] = {}
    for name, config in (("sd35", SD35), ("flux", FLUX)):
        with torch.device("meta"):
            model = AutoencoderKL(**config)
        record[name] = {
            "config": config,
            "parameters": sum(p.numel() for p in model.parameters()),
            "keys": {k: list(v.shape) for k, v in model.state_dict().items()},
        }
        print(name, record[name]["parameters"])
    (DATA / "vae_keys.json").write_text(json.dumps(record, indent=0) + "\n")


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_vae_fixtures.py (no arguments)")
    make()
