"""Our MMDiT against diffusers' `SD3Transformer2DModel` in PyTorch, same weights, same inputs,
same CPU, timed side by side (`docs/performance.md`, "Against diffusers").

Run by hand in a venv with torch, diffusers and this checkout (as `tools/make_sd3_fixtures.py`;
the library and its tests never import torch):

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0 diffusers safetensors
    /tmp/venv-torch/bin/pip install -e .
    PYTHONPATH=. /tmp/venv-torch/bin/python tools/diffusers_speed.py [--rounds 9] [--threads 2]

The configuration is `bench.models`' MMDiT (SD3.5-style: 4 blocks, dual attention in blocks 0
and 1, RMS qk-norm, width 256, 4 heads, a 32x32x16 latent, 64 text tokens, batch 4, float32).
diffusers builds the model with random weights (its own initialisation, then every parameter
drawn at random so no adaLN layer is zero); `load_diffusers` reads the saved folder. The
outputs and the gradients of a squared error are checked equal first (relative 1e-4), then
each program is timed once per round in a rotated order, ours in every layout `bench.models`
has for the MMDiT and PyTorch eager with `--threads` intra-op threads:

- `forward`: one velocity of every row (`torch.no_grad`);
- `train`: forward and backward of a squared error (no optimizer; PyTorch's gradients set to
  `None` before each backward, as `optimizer.zero_grad()` does);
- `sample`: 10 Euler steps (ours one `lax.scan`, PyTorch a Python loop under `no_grad`).

Prints a Markdown table: median milliseconds and the median over rounds of PyTorch's time
over ours (above 1: ours is faster).
"""

import argparse
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from diffusers import SD3Transformer2DModel

from bench.models import BATCH, SAMPLE_STEPS, _attention_layouts, _in_layout, programs
from flowgrpo_eqx.models import load_diffusers


CONFIG = dict(
    sample_size=32,
    patch_size=2,
    in_channels=16,
    num_layers=4,
    attention_head_dim=64,
    num_attention_heads=4,
    joint_attention_dim=256,
    caption_projection_dim=256,
    pooled_projection_dim=256,
    out_channels=16,
    pos_embed_max_size=32,
    dual_attention_layers=(0, 1),
    qk_norm="rms_norm",
)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layouts", default=None, help="separated by ';'; default every one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peer = SD3Transformer2DModel(**CONFIG).eval()
    with torch.no_grad():
        for parameter in peer.parameters():
            parameter.copy_(0.05 * torch.randn_like(parameter))
    folder = tempfile.mkdtemp(prefix="flowgrpo-diffusers-speed-")
    peer.save_pretrained(folder)
    ours = load_diffusers(folder, context_length=64)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 32, 32, 16)).astype(np.float32)
    t = rng.uniform(0.05, 0.95, BATCH).astype(np.float32)
    context = rng.standard_normal((BATCH, 64, 256)).astype(np.float32)
    pooled = rng.standard_normal((BATCH, 256)).astype(np.float32)
    target = rng.standard_normal(x.shape).astype(np.float32)
    cond = {"context": jnp.asarray(context), "pooled": jnp.asarray(pooled)}

    x_torch = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    target_torch = torch.from_numpy(target).permute(0, 3, 1, 2).contiguous()
    context_torch, pooled_torch = torch.from_numpy(context), torch.from_numpy(pooled)

    def peer_velocity(latent: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = peer(
            hidden_states=latent,
            encoder_hidden_states=context_torch,
            pooled_projections=pooled_torch,
            timestep=1000.0 * times,
            return_dict=False,
        )[0]
        return out

    def peer_forward() -> torch.Tensor:
        with torch.no_grad():
            return peer_velocity(x_torch, torch.from_numpy(t))

    def peer_train() -> torch.Tensor:
        for parameter in peer.parameters():
            parameter.grad = None
        loss = torch.mean(torch.square(peer_velocity(x_torch, torch.from_numpy(t)) - target_torch))
        loss.backward()
        return loss

    grid = torch.linspace(1.0, 0.0, SAMPLE_STEPS + 1)

    def peer_sample() -> torch.Tensor:
        latent = x_torch
        with torch.no_grad():
            for now, later in zip(grid[:-1], grid[1:], strict=True):
                latent = latent + (later - now) * peer_velocity(latent, now.expand(BATCH))
        return latent

    # Equal first: outputs, the loss and the gradient with respect to the input latent.
    layouts = _attention_layouts(quick=False)
    layouts = {name: s for name, s in layouts.items() if s.get("dtype", "float32") == "float32"}
    if args.layouts is not None:
        wanted = [name.strip() for name in args.layouts.split(";")]
        layouts = {name: layouts[name] for name in wanted}
    reference = peer_forward().permute(0, 2, 3, 1).numpy()
    x_grad_torch = x_torch.clone().requires_grad_(True)
    torch.mean(
        torch.square(peer_velocity(x_grad_torch, torch.from_numpy(t)) - target_torch)
    ).backward()
    assert x_grad_torch.grad is not None
    peer_x_grad = x_grad_torch.grad.permute(0, 2, 3, 1).numpy()

    variants: dict[str, Any] = {}
    for name, settings in layouts.items():
        model = _in_layout(ours, settings)
        built = programs(model, jnp.asarray(x), jnp.asarray(t), cond)
        out = np.asarray(jax.jit(built["forward"][0])(*built["forward"][1]))

        def x_loss(latent: jax.Array, model: Any = model) -> jax.Array:
            v = jax.vmap(model)(latent, jnp.asarray(t), cond)
            return jnp.mean(jnp.square(v - jnp.asarray(target)))

        x_grad = np.asarray(jax.grad(x_loss)(jnp.asarray(x)))
        difference = (_relative(out, reference), _relative(x_grad, peer_x_grad))
        print(f"{name}: output {difference[0]:.2e}, input gradient {difference[1]:.2e} relative",
              file=sys.stderr)  # fmt: skip
        if max(difference) > 1e-4:
            raise SystemExit(f"{name}: differs from diffusers by {difference}")
        for program, (function, program_args) in built.items():
            compiled = jax.jit(function).lower(*program_args).compile()
            variants[f"{name} | {program}"] = lambda c=compiled, a=program_args: c(*a)
    variants.update(
        {
            "torch | forward": peer_forward,
            "torch | train": peer_train,
            "torch | sample": peer_sample,
        }
    )

    def ready(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            return
        jax.block_until_ready(value)

    names = list(variants)
    for name in names:
        ready(variants[name]())
    wall: dict[str, list[float]] = {name: [] for name in names}
    for index in range(args.rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            ready(variants[name]())
            wall[name].append(time.perf_counter() - started)
        print(f"round {index + 1}/{args.rounds}", file=sys.stderr)

    heading = f"torch {torch.__version__} ({args.threads} threads), jax {jax.__version__}, "
    heading += f"{args.rounds} rounds; ms = median, ratio = median over rounds of torch / ours"
    print(heading + "\n")
    print("| ours | forward ms | ratio | train ms | ratio | 10-step sample ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in [*layouts, "torch"]:
        cells = []
        for program in ("forward", "train", "sample"):
            mine = np.asarray(wall[f"{name} | {program}"])
            peer_times = np.asarray(wall[f"torch | {program}"])
            cells.append(f"{1e3 * np.median(mine):.1f}")
            cells.append("" if name == "torch" else f"{np.median(peer_times / mine):.2f}x")
        label = "diffusers (PyTorch eager)" if name == "torch" else name
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
