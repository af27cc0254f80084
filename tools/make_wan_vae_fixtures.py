"""Fixtures for `AutoencoderKLWan` and diffusers' Wan `vae/` format, made with diffusers itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch and diffusers (diffusers 0.42.1, torch 2.13.0 CPU); the library
and its tests never import torch:

    /tmp/venv-torch/bin/python tools/make_wan_vae_fixtures.py

It writes into `tests/data/`:

- `wan_vae_tiny/`: a tiny random `AutoencoderKLWan` with Wan 2.1's structure at a tiny width
    (four levels, `temperal_downsample [False, True, True]`: spatial-only first, then two
    temporal downsamplings, so 4x in time and 8x in space; one resnet per level; the channels
    growing, so with shortcut convolutions) and per-channel latent statistics off 0 and 1
    (its `attn_scales` empty, as diffusers' encoder cannot run any other), with `io.npz`: a
    video of 9 frames (1 + 4k, as Wan reads them) as 8-bit pixels (`pixels`, `[F, H, W, C]`;
    the video is `pixels / 127.5 - 1` in float32, channels-last, in `[-1, 1]`), a noise draw
    (`noise`), diffusers' posterior mean and log-variance (`mean`, `logvar`:
    `vae.encode(video).latent_dist`, which encodes the first frame alone, then groups of four
    frames, carrying its causal cache), the latent the Wan pipelines give the transformer for
    the mean and for the sample `mean + std * noise` (`latent`, `sampled`: `(z - latents_mean)
    * (1 / latents_std)`, as `WanImageToVideoPipeline` normalises its condition), and the
    video decoded from `latent` as `WanPipeline` decodes it (`decoded`: `vae.decode(latent /
    (1 / latents_std) + latents_mean)`, one latent frame at a time, clamped to `[-1, 1]`);
- `wan_vae_keys.json`: every key of Wan 2.1's VAE state dict with its shape (diffusers'
    defaults, which are `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`'s `vae/config.json`) and its
    parameter count, built on torch's 'meta' device.
"""

import json
import pathlib
import sys
from typing import Any


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
TINY = dict(
    base_dim=4,
    z_dim=4,
    dim_mult=[1, 1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[0.3, -0.2, 0.1, -0.4],
    latents_std=[1.5, 0.7, 2.1, 1.2],
    is_residual=False,
    in_channels=3,
    out_channels=3,
    patch_size=None,
    scale_factor_temporal=4,
    scale_factor_spatial=8,
)


def _tiny(name: str, config: dict[str, Any]) -> None:
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            # Away from 0 and 1 (the RMS norms' gammas start at 1, nothing may sit at 0), the
            # weights scaled by their fan-in so that few decoded values reach the clamp.
            if key.endswith("gamma"):
                param.copy_(0.2 * torch.randn_like(param) + 1.0)
            elif param.ndim > 1:
                scale = 0.6 / param[0].numel() ** 0.5
                param.copy_(scale * (torch.randn_like(param) + 0.05))
            else:
                param.copy_(0.05 * torch.randn_like(param) + 0.01)
    folder = DATA / name
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "diffusion_pytorch_model.safetensors").chmod(0o644)
    pixels = rng.integers(0, 256, (9, 16, 24, 3), dtype=np.uint8)
    video = pixels.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    z_dim = config["z_dim"]
    mean_c = torch.tensor(config["latents_mean"]).view(1, z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config["latents_std"]).view(1, z_dim, 1, 1, 1)
    with torch.no_grad():
        x = torch.from_numpy(video).permute(3, 0, 1, 2)[None]
        posterior = model.encode(x).latent_dist
        mean, logvar = posterior.mean, posterior.logvar
        noise = torch.from_numpy(rng.standard_normal(tuple(mean.shape)).astype(np.float32))
        sampled = mean + posterior.std * noise
        latent = (mean - mean_c) * inv_std
        decoded = model.decode(latent / inv_std + mean_c).sample

    def last(x: Any) -> Any:
        return x[0].permute(1, 2, 3, 0).numpy()

    out = last(decoded)
    np.savez(
        folder / "io.npz",
        pixels=pixels,
        noise=last(noise),
        mean=last(mean),
        logvar=last(logvar),
        latent=last(latent),
        sampled=last((sampled - mean_c) * inv_std),
        decoded=out,
    )
    clipped = float(np.mean(np.abs(out) >= 1.0))
    print(name, "latent", last(latent).shape, "decoded", out.shape, "clipped", clipped)


def make() -> None:
    import torch
    from diffusers import AutoencoderKLWan

    _tiny("wan_vae_tiny", TINY)
    with torch.device("meta"):
        model = AutoencoderKLWan()
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    record = {
        "wan_2_1": {
            "config": config,
            "parameters": sum(p.numel() for p in model.parameters()),
            "keys": {k: list(v.shape) for k, v in model.state_dict().items()},
        }
    }
    print("wan_2_1", record["wan_2_1"]["parameters"])
    (DATA / "wan_vae_keys.json").write_text(json.dumps(record, indent=0) + "\n")


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_wan_vae_fixtures.py (no arguments)")
    make()
