"""`python -m bench.device_loop [--size small|medium] [--calls N]`: the whole loop on one device.

The program of `docs/guides/whole_loop.md` (prompts' token ids -> SD3-style prompt embeddings
-> the Flow-GRPO rollout -> the VAE's decode -> PickScore -> group advantages, one compiled
program) and the update that follows it, on random models of an SD3-like layout, timed on
this machine's default device: the median of `calls` calls after one that compiles. The
program runs under `jax.transfer_guard_device_to_host("disallow")`, so a copy of the images
or the scores to the host inside it would raise: the reward is computed on the device.
Prints one JSON object.
"""

import argparse
import json
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import flowgrpo_eqx as fg
from flowgrpo_eqx.models import (
    AutoencoderKL,
    CLIPModel,
    CLIPTextModel,
    MMDiT,
    SD3PromptEncoder,
    T5Encoder,
    TowerShape,
)
from flowgrpo_eqx.rewards import DeviceReward, PickScore
from flowgrpo_eqx.train import Trainer, default_optimizer


SIZES: dict[str, dict[str, int]] = {
    # latent side, MMDiT width and depth, text widths, VAE channels, prompts, steps, and the
    # microbatches of the update (medium's whole batch of transitions plans 63 GiB on a TPU)
    "small": dict(latent=8, width=64, depth=2, text=32, vae=16, prompts=4, steps=6, microbatches=1),
    "medium": dict(
        latent=32, width=384, depth=8, text=256, vae=64, prompts=8, steps=11, microbatches=8
    ),
}
GROUPS = 4
VOCAB, END, T5_LENGTH = 64, 63, 32


def parts(size: dict[str, int]) -> dict[str, Any]:
    """The random models, objective, rollout and trainer of one size."""
    keys = jax.random.split(jax.random.key(0), 6)
    text = size["text"]
    encoder = SD3PromptEncoder(
        CLIPTextModel(TowerShape(text, 4, 2 * text, 2, "quick_gelu", 1e-5), VOCAB, 77, END, text,
                      key=keys[0]),
        CLIPTextModel(TowerShape(text, 4, 2 * text, 2, "gelu", 1e-5), VOCAB, 77, END, text,
                      key=keys[1]),
        T5Encoder(vocab_size=VOCAB, width=4 * text, ff_width=4 * text, heads=4, head_dim=text // 4,
                  key=keys[2]),
    )  # fmt: skip
    channels = size["vae"]
    vae = AutoencoderKL(
        latent_channels=4, block_out_channels=(channels // 2, channels), key=keys[3]
    )
    model = MMDiT(
        image_size=size["latent"],
        channels=4,
        depth=size["depth"],
        width=size["width"],
        heads=size["width"] // 64,
        context_length=77 + T5_LENGTH,
        context_dim=4 * text,
        pooled_dim=2 * text,
        key=keys[4],
    )
    tower = TowerShape(text, 4, 2 * text, 2, "gelu", 1e-5)
    image = 2 * size["latent"]
    pickscore = PickScore(
        CLIPModel(tower, tower, text, VOCAB, 77, END, image_size=image, patch_size=image // 4,
                  key=keys[5])
    )  # fmt: skip
    objective = fg.FlowGRPOObjective(
        model,
        fg.RectifiedFlow(shift=3.0),
        fg.InputSpec(select=("context", "pooled"), latent_shape=(size["latent"],) * 2 + (4,)),
        sde=fg.FlowSDE(noise_level=0.7),
        guidance=None,
        autoencoder=vae,
        clip_range=0.2,
        steps=size["steps"],
    )
    rollout = fg.FlowRollout(
        objective, DeviceReward(pickscore, key="prompt"), groups=GROUPS, steps=size["steps"]
    )
    trainer = Trainer(
        objective, default_optimizer(learning_rate=1e-4), microbatches=size["microbatches"]
    )
    ids = np.random.default_rng(0).integers(1, END, (size["prompts"], 77)).astype(np.int32)
    ids[:, 12:] = END
    return dict(
        objective=objective,
        rollout=rollout,
        trainer=trainer,
        encoder=encoder,
        pickscore=pickscore,
        clip_ids=jnp.asarray(ids),
        t5_ids=jnp.asarray(ids[:, :T5_LENGTH]),
    )


@eqx.filter_jit
def rollout_to_advantages(
    rollout: Any, policy: Any, encoder: Any, pickscore: Any, clip_ids: Any, t5_ids: Any, key: Any
) -> Any:
    """Token ids to the rollout, its decoded images, their PickScores and the advantages."""
    condition = jax.vmap(encoder)(clip_ids, clip_ids, t5_ids)
    rows = {**condition, "prompt": jax.vmap(pickscore.prompt_embedding)(clip_ids)}
    rows = jax.tree.map(lambda x: jnp.repeat(x, rollout.groups, axis=0), rows)
    generated = rollout.generate(policy, rows, key)
    scores = jax.vmap(pickscore)(generated.samples, rows["prompt"])
    return rows, generated, scores, fg.device_group_advantages(scores, rollout.groups)


def measure(name: str, calls: int) -> dict[str, Any]:
    """Median milliseconds of the program and of the update after a compiling call."""
    p = parts(SIZES[name])
    state = p["trainer"].init(jax.random.key(1))
    program_ms, update_ms = [], []
    for call in range(calls + 1):
        policy = p["objective"].sampling_policy(state.variables)
        started = time.perf_counter()
        with jax.transfer_guard_device_to_host("disallow"):
            rows, generated, scores, advantages = rollout_to_advantages(
                p["rollout"], policy, p["encoder"], p["pickscore"], p["clip_ids"],
                p["t5_ids"], jax.random.key(call),
            )  # fmt: skip
            jax.block_until_ready(advantages)  # type: ignore[no-untyped-call]
        scored = time.perf_counter()
        batch = p["rollout"].active_sampler.batch(
            p["rollout"].draw(policy, rows), generated, np.asarray(advantages)
        )
        state, metrics = p["trainer"].update(state, batch)
        jax.block_until_ready(metrics)  # type: ignore[no-untyped-call]
        if call:
            program_ms.append(1e3 * (scored - started))
            update_ms.append(1e3 * (time.perf_counter() - scored))
    return {
        "size": SIZES[name],
        "samples": SIZES[name]["prompts"] * GROUPS,
        "program_ms": round(statistics.median(program_ms), 2),
        "update_ms": round(statistics.median(update_ms), 2),
        "reward_mean": float(jnp.mean(scores)),
        "transfer_guard": "device_to_host disallowed inside the program: nothing came back",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.device_loop", description=__doc__)
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--calls", type=int, default=5)
    arguments = parser.parse_args(argv)
    report = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        arguments.size: measure(arguments.size, arguments.calls),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
