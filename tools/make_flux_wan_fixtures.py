"""Fixtures for `Flux` and `Wan` and diffusers' FLUX and Wan formats, made with diffusers itself.

As `tools/make_sd3_fixtures.py` (read its docstring for the environment): the library and its
tests never import torch; this script runs by hand in a venv with torch and diffusers:

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0 diffusers peft safetensors transformers accelerate

(on the project's machines `torch==2.13.0` is the CPU build on disk; this was run with
diffusers 0.42.1).

`make` (torch venv) writes into `tests/data/`:

- `flux_tiny/`: a tiny random `FluxTransformer2DModel` with FLUX.1-dev's structure (guidance
    embedding, double- and single-stream blocks, 3-axis RoPE), every parameter drawn at random,
    in the diffusers format, with `io.npz`: inputs in our conventions (`x` `[B, H, W, C]` on a
    non-square latent, `t` in [0, 1], `context`, `pooled`, `guidance`) and diffusers' output
    for them (`v`, channels-last), run as `FluxPipeline` runs the transformer (latents packed
    2 x 2 by `_pack_latents`, `img_ids` from `_prepare_latent_image_ids`, zero `txt_ids`,
    `timestep = t` and `guidance = g`, which the transformer multiplies by 1000, output
    unpacked by `_unpack_latents`);
- `flux_keys.json`: every key of FLUX.1-dev's transformer state dict with its shape, and the
    parameter counts of FLUX.1-dev and FLUX.1-schnell, from the models built on the 'meta'
    device (nothing downloaded or allocated), from their published `config.json`;
- `flux_sigmas.json`: the sigmas `FluxPipeline` sets on FLUX.1-dev's scheduler
    (`FlowMatchEulerDiscreteScheduler` with `use_dynamic_shifting`, `mu` from the image's token
    count by the pipeline's `calculate_shift`) for a few step counts and resolutions, and
    FLUX.1-schnell's (no dynamic shifting, `shift` 1);
- `wan_tiny/`: a tiny random `WanTransformer3DModel` with Wan 2.1's structure (3D patches
    `(1, 2, 2)`, 3-axis RoPE, RMS qk-norm across heads, cross-attention with its affine norm),
    every parameter drawn at random, with `io.npz`: a video latent `x` `[B, F, H, W, C]`
    (non-square frames), `t`, the text states `context`, and diffusers' output `v`
    (channels-last), called as `WanPipeline` calls it (`timestep = 1000 t`);
- `wan_keys.json`: every key of Wan 2.1-T2V-1.3B's transformer state dict with its shape, and
    the parameter counts of the 1.3B and the 14B, built on the 'meta' device from their
    published `config.json`;
- `wan_sigmas.json`: the sigmas of DanceGRPO's Wan 2.1 rollouts (`sd3_time_shift(shift,
    torch.linspace(1, 0, steps + 1))`, its `fastvideo` trainers' grid, `--shift 3` in its Wan
    scripts), computed in torch for a few shifts and step counts.

    /tmp/venv-torch/bin/python tools/make_flux_wan_fixtures.py make

(`make-wan` makes the Wan fixtures alone.)

`export OUT` (the project's environment, with JAX) loads `flux_tiny` and `wan_tiny` with
`load_diffusers`, adds random LoRA adapters to every linear layer, and writes for each
`OUT/<name>/roundtrip` (`save_diffusers` of the model), `OUT/<name>/merged` (`save_diffusers`
of `lora.merge`), `OUT/<name>/lora` (`save_diffusers_lora`) and `OUT/<name>/expected.npz` (our
velocity of the LoRA policy on the fixture inputs).

`check OUT` (torch venv) loads them with `from_pretrained` and, for the adapters, the base
fixture with `FluxPipeline`'s or `WanPipeline`'s LoRA loader (`lora_state_dict` and
`load_lora_into_transformer`, what `pipe.load_lora_weights` does for the transformer), and
checks relative to the largest `|v|`: the round trip computes in diffusers what the fixture
does, and the merged policy what the base with the adapters does (to 1e-5); and both agree with
our velocity of the policy (to 1e-4, JAX against torch).

    PYTHONPATH=. .venv/bin/python tools/make_flux_wan_fixtures.py export /tmp/flux-wan-out
    /tmp/venv-torch/bin/python tools/make_flux_wan_fixtures.py check /tmp/flux-wan-out
"""

import json
import pathlib
import sys
from typing import Any


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
BATCH = 2
CONTEXT_LENGTH = 5
LATENT = (8, 6, 4)  # height, width, channels: a non-square latent checks the packing's order
FLUX_TINY = dict(
    patch_size=1,
    in_channels=4 * LATENT[2],
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    pooled_projection_dim=10,
    guidance_embeds=True,
    axes_dims_rope=(2, 2, 4),
)
# black-forest-labs/FLUX.1-dev and FLUX.1-schnell, transformer/config.json.
FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_SCHNELL = dict(FLUX_DEV, guidance_embeds=False)
# scheduler/scheduler_config.json of each.
DEV_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
WAN_LATENT = (3, 4, 6, 4)  # frames, height, width, channels
WAN_TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=WAN_LATENT[3],
    out_channels=WAN_LATENT[3],
    text_dim=12,
    freq_dim=256,
    ffn_dim=16,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and Wan2.1-T2V-14B-Diffusers, transformer/config.json.
WAN_1_3B = dict(
    WAN_TINY,
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    ffn_dim=8960,
    num_layers=30,
)
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)


def _diffusers_velocity(model: Any, inputs: dict[str, Any]) -> Any:
    """diffusers' output for our channels-last inputs, as `FluxPipeline` calls the model."""
    import torch
    from diffusers import FluxPipeline

    height, width, channels = inputs["x"].shape[1:]
    latents = torch.from_numpy(inputs["x"]).permute(0, 3, 1, 2)
    packed = FluxPipeline._pack_latents(latents, BATCH, channels, height, width)
    img_ids = FluxPipeline._prepare_latent_image_ids(
        BATCH, height // 2, width // 2, "cpu", torch.float32
    )
    txt_ids = torch.zeros(inputs["context"].shape[1], 3)
    with torch.no_grad():
        out = model(
            hidden_states=packed,
            encoder_hidden_states=torch.from_numpy(inputs["context"]),
            pooled_projections=torch.from_numpy(inputs["pooled"]),
            timestep=torch.from_numpy(inputs["t"]),
            guidance=torch.from_numpy(inputs["guidance"]) if "guidance" in inputs else None,
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]
    # `_unpack_latents` takes the image's pixel size and the VAE's factor (8).
    unpacked = FluxPipeline._unpack_latents(out, 8 * height, 8 * width, 8)
    return unpacked.permute(0, 2, 3, 1).numpy()


def _sigmas() -> dict[str, Any]:
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    dev: dict[str, list[float]] = {}
    for steps in (4, 16, 28):
        for tokens in (1024, 4096):  # 512 x 512 and 1024 x 1024 images
            scheduler = FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER)
            mu = calculate_shift(
                tokens,
                DEV_SCHEDULER["base_image_seq_len"],
                DEV_SCHEDULER["max_image_seq_len"],
                DEV_SCHEDULER["base_shift"],
                DEV_SCHEDULER["max_shift"],
            )
            # FluxPipeline.__call__'s default sigmas.
            sigmas = np.linspace(1.0, 1 / steps, steps)
            scheduler.set_timesteps(sigmas=sigmas, mu=mu)
            dev[f"{steps}/{tokens}"] = [float(s) for s in scheduler.sigmas]
    schnell: dict[str, list[float]] = {}
    for steps in (1, 4):
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHNELL_SCHEDULER)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
        schnell[str(steps)] = [float(s) for s in scheduler.sigmas]
    return {
        "dev_scheduler": DEV_SCHEDULER,
        "dev": dev,
        "schnell_scheduler": SCHNELL_SCHEDULER,
        "schnell": schnell,
    }


def _wan_velocity(model: Any, inputs: dict[str, Any]) -> Any:
    """diffusers' output for our channels-last video latents, as `WanPipeline` calls the model."""
    import torch

    with torch.no_grad():
        out = model(
            hidden_states=torch.from_numpy(inputs["x"]).permute(0, 4, 1, 2, 3),
            timestep=torch.from_numpy(inputs["t"]) * 1000,
            encoder_hidden_states=torch.from_numpy(inputs["context"]),
            return_dict=False,
        )[0]
    return out.permute(0, 2, 3, 4, 1).numpy()


def _wan_sigmas() -> dict[str, list[float]]:
    import torch

    def sd3_time_shift(shift: float, t: Any) -> Any:
        # DanceGRPO, fastvideo/train_grpo_*.py: `(shift * t) / (1 + (shift - 1) * t)`.
        return (shift * t) / (1 + (shift - 1) * t)

    return {
        f"{shift}/{steps}": [
            float(s) for s in sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))
        ]
        for shift in (3.0, 5.0)
        for steps in (16, 50)
    }


def make_wan() -> None:
    import numpy as np
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    model = WanTransformer3DModel(**WAN_TINY).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.3 * torch.randn_like(param) + 0.05)
    folder = DATA / "wan_tiny"
    model.save_pretrained(folder, safe_serialization=True)
    inputs = {
        "x": rng.standard_normal((BATCH, *WAN_LATENT)),
        "t": np.asarray([0.9, 0.27]),
        "context": rng.standard_normal((BATCH, CONTEXT_LENGTH, WAN_TINY["text_dim"])),
    }
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    v = _wan_velocity(model, inputs)
    np.savez(folder / "io.npz", **inputs, v=v)
    print("wan_tiny v", v.shape, float(np.abs(v).mean()))
    with torch.device("meta"):
        small = WanTransformer3DModel(**WAN_1_3B)
        large = WanTransformer3DModel(**WAN_14B)
    record = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in WAN_1_3B.items()},
        "t2v_1_3b_parameters": sum(p.numel() for p in small.parameters()),
        "t2v_14b_parameters": sum(p.numel() for p in large.parameters()),
        "keys": {k: list(v.shape) for k, v in small.state_dict().items()},
    }
    (DATA / "wan_keys.json").write_text(json.dumps(record, indent=0) + "\n")
    print("Wan 1.3B", record["t2v_1_3b_parameters"], "14B", record["t2v_14b_parameters"])
    (DATA / "wan_sigmas.json").write_text(json.dumps(_wan_sigmas(), indent=1) + "\n")


def make() -> None:
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = FluxTransformer2DModel(**FLUX_TINY).eval()
    with torch.no_grad():
        for param in model.parameters():
            # Away from 0 and 1 (norm weights start at 1, nothing else may sit at 0).
            param.copy_(0.3 * torch.randn_like(param) + 0.05)
    folder = DATA / "flux_tiny"
    model.save_pretrained(folder, safe_serialization=True)
    inputs = {
        "x": rng.standard_normal((BATCH, *LATENT)),
        "t": np.asarray([0.9, 0.27]),
        "context": rng.standard_normal((BATCH, CONTEXT_LENGTH, FLUX_TINY["joint_attention_dim"])),
        "pooled": rng.standard_normal((BATCH, FLUX_TINY["pooled_projection_dim"])),
        "guidance": np.asarray([3.5, 1.0]),
    }
    inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
    v = _diffusers_velocity(model, inputs)
    np.savez(folder / "io.npz", **inputs, v=v)
    print("flux_tiny v", v.shape, float(np.abs(v).mean()))

    with torch.device("meta"):
        dev = FluxTransformer2DModel(**FLUX_DEV)
        schnell = FluxTransformer2DModel(**FLUX_SCHNELL)
    record = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in FLUX_DEV.items()},
        "dev_parameters": sum(p.numel() for p in dev.parameters()),
        "schnell_parameters": sum(p.numel() for p in schnell.parameters()),
        "keys": {k: list(v.shape) for k, v in dev.state_dict().items()},
    }
    (DATA / "flux_keys.json").write_text(json.dumps(record, indent=0) + "\n")
    print("FLUX.1-dev", record["dev_parameters"], "FLUX.1-schnell", record["schnell_parameters"])

    sigmas = _sigmas()
    (DATA / "flux_sigmas.json").write_text(json.dumps(sigmas, indent=1) + "\n")
    print("dev sigmas 4/1024:", [round(s, 5) for s in sigmas["dev"]["4/1024"]])
    make_wan()


# Per fixture: the latent size `load_diffusers` runs it at, and the condition from `io.npz`.
_EXPORTED = {
    "flux_tiny": (LATENT[:2], ("context", "pooled", "guidance")),
    "wan_tiny": (WAN_LATENT[:3], None),
}


def export(out: pathlib.Path) -> None:
    import equinox as eqx
    import jax
    import numpy as np

    from flowgrpo_eqx import lora
    from flowgrpo_eqx.models import load_diffusers, save_diffusers, save_diffusers_lora

    for name, (size, keys) in _EXPORTED.items():
        folder = out / name
        model = load_diffusers(DATA / name, image_size=size, context_length=CONTEXT_LENGTH)
        policy = lora.add(model, 2, key=jax.random.key(1), alpha=3.0)
        # `b` starts at zero: give every adapter a random `b` too.
        rng = np.random.default_rng(1)
        policy = eqx.tree_at(
            lambda p: [a.b for a in p.adapters],
            policy,
            [
                jax.numpy.asarray(0.2 * rng.standard_normal(a.b.shape), np.float32)
                for a in policy.adapters
            ],
        )
        save_diffusers(folder / "roundtrip", model)
        save_diffusers(folder / "merged", lora.merge(policy))
        save_diffusers_lora(folder / "lora", policy)
        io = dict(np.load(DATA / name / "io.npz"))
        cond = io["context"] if keys is None else {key: io[key] for key in keys}
        v = eqx.filter_jit(jax.vmap(policy))(io["x"], io["t"], cond)
        np.savez(folder / "expected.npz", v=np.asarray(v))
        print(name, "exported", len(policy.layer_paths), "adapted layers")


def check(out: pathlib.Path) -> None:
    import numpy as np
    from diffusers import (
        FluxPipeline,
        FluxTransformer2DModel,
        WanPipeline,
        WanTransformer3DModel,
    )

    def error(got: Any, want: Any) -> float:
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    worst = {"diffusers": 0.0, "ours": 0.0}
    kinds = {
        "flux_tiny": (FluxTransformer2DModel, FluxPipeline, _diffusers_velocity),
        "wan_tiny": (WanTransformer3DModel, WanPipeline, _wan_velocity),
    }
    for name, (model_class, pipeline, velocity) in kinds.items():
        folder = out / name
        io = dict(np.load(DATA / name / "io.npz"))
        ours = np.load(folder / "expected.npz")["v"]
        roundtrip = model_class.from_pretrained(folder / "roundtrip").eval()
        merged = model_class.from_pretrained(folder / "merged").eval()
        base = model_class.from_pretrained(DATA / name).eval()
        # What `pipe.load_lora_weights(folder / "lora")` does for the transformer.
        if pipeline is FluxPipeline:
            state, alphas = pipeline.lora_state_dict(folder / "lora", return_alphas=True)
            pipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=base)
        else:
            state = pipeline.lora_state_dict(folder / "lora")
            pipeline.load_lora_into_transformer(state, transformer=base)
        with_lora = velocity(base, io)
        merged_v = velocity(merged, io)
        checks = {
            "diffusers: save_diffusers(load_diffusers(fixture)) vs fixture": (
                velocity(roundtrip, io),
                io["v"],
            ),
            "diffusers: save_diffusers(lora.merge(policy)) vs base + save_diffusers_lora": (
                merged_v,
                with_lora,
            ),
            "ours: policy vs diffusers' save_diffusers(lora.merge(policy))": (ours, merged_v),
            "ours: policy vs diffusers' base + save_diffusers_lora": (ours, with_lora),
        }
        for label, (got, want) in checks.items():
            e = error(got, want)
            side = label.split(":")[0]
            worst[side] = max(worst[side], e)
            print(f"{name} {label}: max |error| / max |v| = {e:.2e}")
        # The base with adapters must differ from the base: the adapters were loaded.
        assert error(with_lora, io["v"]) > 1e-3, f"{name}: the LoRA loader changed nothing"
    assert worst["diffusers"] < 1e-5 and worst["ours"] < 1e-4, worst
    print("ok", worst)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "make" and len(sys.argv) == 2:
        make()
    elif command == "make-wan" and len(sys.argv) == 2:
        make_wan()
    elif command in ("export", "check") and len(sys.argv) == 3:
        (export if command == "export" else check)(pathlib.Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
