"""Fixtures for `models.load_diffusers` / `save_diffusers`, made with diffusers itself.

The library and its tests never import torch; this script is the one place diffusers runs,
by hand, in a separate environment with torch and diffusers:

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch diffusers peft safetensors transformers accelerate numpy

It has three commands.

`make` (torch venv) writes `tests/data/` (about 330 kB in all):

- `sd3_tiny/` and `sd35_tiny/`: tiny random `SD3Transformer2DModel`s in the diffusers format
  (`config.json`, `diffusion_pytorch_model.safetensors`), SD3's layout and SD3.5's (RMS
  qk-norm, a dual-attention block), every parameter drawn at random (none left at 0 or 1),
  with `io.npz`: inputs in our conventions (`x` `[B, H, W, C]`, `t` in [0, 1], `context`,
  `pooled`) and diffusers' output for them (`v`, channels-last; diffusers' timestep is
  `1000 t`);
- `sd35_medium_keys.json`: every key of the full-size SD3.5-Medium transformer's state
  dict with its shape, and diffusers' parameter count (SD3-Medium's too), from the model
  built on the 'meta' device (no weights are downloaded or allocated);
- `flow_match_sigmas.json`: `FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(n)`
  sigmas for a few `n`.

    /tmp/venv-torch/bin/python tools/make_sd3_fixtures.py make

`export OUT` (the project's environment, with JAX) loads each fixture with
`load_diffusers`, adds random LoRA adapters to every layer, and writes
`OUT/<name>/merged` (`save_diffusers` of `lora.merge`), `OUT/<name>/lora`
(`save_diffusers_lora`) and `OUT/<name>/expected.npz` (our velocity of the LoRA policy on
the fixture inputs).

`check OUT` (torch venv) loads `OUT/<name>/merged` with `SD3Transformer2DModel.from_pretrained`
and the base fixture plus `OUT/<name>/lora` with `StableDiffusion3Pipeline`'s LoRA loader,
and checks, relative to the largest `|v|`: that diffusers computes with the model
`save_diffusers(load_diffusers(fixture))` what it computes with the fixture, and with the
merged LoRA policy what it computes with the base and the exported adapters (to 1e-5); and
that both agree with our velocity of the policy (to 1e-4, JAX against torch).

    PYTHONPATH=. .venv/bin/python tools/make_sd3_fixtures.py export /tmp/sd3-out
    /tmp/venv-torch/bin/python tools/make_sd3_fixtures.py check /tmp/sd3-out
"""

import json
import pathlib
import sys
from typing import Any


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
BATCH = 2
CONTEXT_LENGTH = 5
_SD3_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=12,
    caption_projection_dim=16,
    pooled_projection_dim=10,
    out_channels=4,
    pos_embed_max_size=6,
)
TINY = {
    "sd3_tiny": _SD3_TINY,
    # SD3.5's layout: one more block, the first with dual attention, and RMS qk-norm.
    "sd35_tiny": {
        **_SD3_TINY,
        "num_layers": 3,
        "dual_attention_layers": (0,),
        "qk_norm": "rms_norm",
    },
}
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
SD3_MEDIUM = dict(SD35_MEDIUM, pos_embed_max_size=192, dual_attention_layers=(), qk_norm=None)


def _diffusers_velocity(model: Any, inputs: dict[str, Any]) -> Any:
    """diffusers' output for our channels-last inputs, channels-last."""
    import torch

    with torch.no_grad():
        t = torch.from_numpy(inputs["t"])
        out = model(
            hidden_states=torch.from_numpy(inputs["x"]).permute(0, 3, 1, 2),
            encoder_hidden_states=torch.from_numpy(inputs["context"]),
            pooled_projections=torch.from_numpy(inputs["pooled"]),
            timestep=t * 1000,
            return_dict=False,
        )[0]
    return out.permute(0, 2, 3, 1).numpy()


def make() -> None:
    import numpy as np
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for name, config in TINY.items():
        model = SD3Transformer2DModel(**config).eval()
        with torch.no_grad():
            for param in model.parameters():
                # Away from 0 and 1 (norm weights start at 1, nothing else may sit at 0).
                param.copy_(0.3 * torch.randn_like(param) + 0.05)
        folder = DATA / name
        model.save_pretrained(folder, safe_serialization=True)
        size = config["sample_size"]
        inputs = {
            "x": rng.standard_normal((BATCH, size, size, config["in_channels"])),
            "t": np.asarray([0.9, 0.27]),
            "context": rng.standard_normal((BATCH, CONTEXT_LENGTH, config["joint_attention_dim"])),
            "pooled": rng.standard_normal((BATCH, config["pooled_projection_dim"])),
        }
        inputs = {k: v.astype(np.float32) for k, v in inputs.items()}
        v = _diffusers_velocity(model, inputs)
        np.savez(folder / "io.npz", **inputs, v=v)
        print(name, "v", v.shape, float(np.abs(v).mean()))

    with torch.device("meta"):
        medium = SD3Transformer2DModel(**SD35_MEDIUM)
        sd3 = SD3Transformer2DModel(**SD3_MEDIUM)
    keys = {k: list(v.shape) for k, v in medium.state_dict().items()}
    record = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in SD35_MEDIUM.items()},
        "parameters": sum(p.numel() for p in medium.parameters()),
        "sd3_medium_parameters": sum(p.numel() for p in sd3.parameters()),
        "keys": keys,
    }
    (DATA / "sd35_medium_keys.json").write_text(json.dumps(record, indent=0) + "\n")
    print("sd35 medium", record["parameters"], "sd3 medium", record["sd3_medium_parameters"])

    sigmas = {}
    for steps in (10, 28, 40):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(steps)
        sigmas[str(steps)] = [float(s) for s in scheduler.sigmas]
    (DATA / "flow_match_sigmas.json").write_text(
        json.dumps({"shift": 3.0, "sigmas": sigmas}, indent=1) + "\n"
    )
    print("sigmas 10:", [round(s, 5) for s in sigmas["10"]])


def export(out: pathlib.Path) -> None:
    import equinox as eqx
    import jax
    import numpy as np

    from flowgrpo_eqx import lora
    from flowgrpo_eqx.models import load_diffusers, save_diffusers, save_diffusers_lora

    for name in TINY:
        model = load_diffusers(DATA / name, context_length=CONTEXT_LENGTH)
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
        save_diffusers(out / name / "roundtrip", model)
        save_diffusers(out / name / "merged", lora.merge(policy))
        save_diffusers_lora(out / name / "lora", policy)
        io = dict(np.load(DATA / name / "io.npz"))
        cond = {"context": io["context"], "pooled": io["pooled"]}
        v = eqx.filter_jit(jax.vmap(policy))(io["x"], io["t"], cond)
        np.savez(out / name / "expected.npz", v=np.asarray(v))
        print(name, "exported", len(policy.layer_paths), "adapted layers")


def check(out: pathlib.Path) -> None:
    import numpy as np
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    def error(got: Any, want: Any) -> float:
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    worst = {"diffusers": 0.0, "ours": 0.0}
    for name in TINY:
        io = dict(np.load(DATA / name / "io.npz"))
        ours = np.load(out / name / "expected.npz")["v"]
        # `save_diffusers(load_diffusers(fixture))` computes in diffusers what the fixture does.
        roundtrip = SD3Transformer2DModel.from_pretrained(out / name / "roundtrip").eval()
        merged = SD3Transformer2DModel.from_pretrained(out / name / "merged").eval()
        base = SD3Transformer2DModel.from_pretrained(DATA / name).eval()
        # What `pipe.load_lora_weights(out / name / "lora")` does for the transformer.
        state = StableDiffusion3Pipeline.lora_state_dict(out / name / "lora")
        StableDiffusion3Pipeline.load_lora_into_transformer(state, transformer=base)
        with_lora = _diffusers_velocity(base, io)
        merged_v = _diffusers_velocity(merged, io)
        checks = {
            "diffusers: save_diffusers(load_diffusers(fixture)) vs fixture": (
                _diffusers_velocity(roundtrip, io),
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
    # Within diffusers (same framework, same weights) to 1e-5; across frameworks to 1e-4.
    assert worst["diffusers"] < 1e-5 and worst["ours"] < 1e-4, worst
    print("ok", worst)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "make":
        make()
    elif command in ("export", "check") and len(sys.argv) == 3:
        (export if command == "export" else check)(pathlib.Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
