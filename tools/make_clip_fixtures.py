"""Fixtures for CLIP's towers (`flowgrpo_eqx.models.load_clip`), made with transformers itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch and transformers (transformers 5.25.0, torch 2.13.0 CPU):

    /tmp/venv-torch/bin/python tools/make_clip_fixtures.py

It writes into `tests/data/clip/`:

- `text_l/`: a tiny random `CLIPTextModel` as SD3's CLIP-L is configured (`quick_gelu`, the
    legacy `eos_token_id` 2, so the pooled state is at the largest id), and `text_g/`: a tiny
    random `CLIPTextModelWithProjection` as OpenCLIP bigG is (`gelu`, `eos_token_id` the last
    id, a projection); each with `io.npz`: token ids `ids` (`[B, 9]`, an end-of-text token
    and padding after it), the tokenizer's `mask`, and transformers' `hidden_states` (every
    layer, `output_hidden_states=True`), `last`, `pooled` and, for `text_g`, `text_embeds`,
    without a mask (as the SD3 pipelines call them) and `pooled_masked` with it;
- `model/`: a tiny random `CLIPModel` as PickScore's is (`gelu` in both towers, 32 x 32
    images in patches of 8), with `io.npz`: `pixels` (normalised, channels-last), `ids`,
    `mask`, transformers' `get_image_features` and `get_text_features` (`image_features`,
    `text_features`), and the PickScore statement of flow_grpo's `pickscore_scorer.py` on
    them (`pickscore`: `exp(logit_scale) * cos(text, image) / 26` per pair);
- `processor.npz`: images in `[0, 1]` (`square`: already 32 x 32; `wide`: 40 x 56) and what
    transformers' `CLIPImageProcessor` (shortest side 32, centre crop 32, PIL bicubic) makes
    of them after flow_grpo's conversion to 8-bit PIL images (`square_pixels`,
    `wide_pixels`, channels-last), and flow_grpo's PickScore of each image for the prompts
    `ids` (`square_pickscore`, `wide_pickscore`) by `model/`, end to end;
- `clip_keys.json`: the parameter counts and every key with its shape of SD3's CLIP-L and
    OpenCLIP bigG text encoders (with projections) and of PickScore's `CLIPModel` (ViT-H/14),
    built on torch's 'meta' device from their published configs.
"""

import json
import pathlib
import sys
from typing import Any


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "clip"
TEXT_L = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=16,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    eos_token_id=2,
)
TEXT_G = dict(TEXT_L, hidden_act="gelu", eos_token_id=98, projection_dim=24)
VISION = dict(
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=5,
    image_size=32,
    patch_size=8,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)


# stabilityai/stable-diffusion-3.5-medium, text_encoder/ and text_encoder_2/config.json.
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
)
CLIP_G = dict(
    CLIP_L,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
)
# yuvalkirstain/PickScore_v1, config.json (OpenCLIP ViT-H/14).
PICKSCORE = dict(
    projection_dim=1024,
    text_config=dict(
        CLIP_L,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        hidden_act="gelu",
    ),
    vision_config=dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_attention_heads=16,
        image_size=224,
        patch_size=14,
        hidden_act="gelu",
    ),
)


def _randomise(model: Any) -> None:
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 0:
                param.fill_(2.3)  # the logit scale: a temperature of exp(2.3)
            else:
                # Away from 0 and 1 (norm weights start at 1, nothing else may sit at 0).
                param.copy_(0.3 * torch.randn_like(param) + 0.02)


def _ids(rng: Any, eos: int) -> tuple[Any, Any]:
    import numpy as np

    ids = rng.integers(3, 90, (2, 9))
    mask = np.ones_like(ids)
    ids[0, 0], ids[1, 0] = 1, 1  # start of text
    ids[0, 6], ids[1, 8] = eos, eos  # end of text
    ids[0, 7:] = 0  # padding after the end
    mask[0, 7:] = 0
    return ids.astype(np.int32), mask.astype(np.int32)


def make() -> None:
    import numpy as np
    import torch
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
    )

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for name, config, cls in (
        ("text_l", TEXT_L, CLIPTextModel),
        ("text_g", TEXT_G, CLIPTextModelWithProjection),
    ):
        model = cls(CLIPTextConfig(**config)).eval()
        _randomise(model)
        model.save_pretrained(OUT / name, safe_serialization=True)
        ids, mask = _ids(rng, config["eos_token_id"])
        with torch.no_grad():
            out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
            masked = model(
                torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
            )
        record = dict(
            ids=ids,
            mask=mask,
            hidden_states=torch.stack(out.hidden_states, dim=1).numpy(),
            last=out.last_hidden_state.numpy(),
        )
        if name == "text_g":
            record["text_embeds"] = out.text_embeds.numpy()
            record["pooled"] = out.last_hidden_state[
                torch.arange(2), (torch.from_numpy(ids) == config["eos_token_id"]).int().argmax(-1)
            ].numpy()
            record["pooled_masked"] = masked.text_embeds.numpy()
        else:
            record["pooled"] = out.pooler_output.numpy()
            record["pooled_masked"] = masked.pooler_output.numpy()
        np.savez(OUT / name / "io.npz", **record)
        print(name, record["hidden_states"].shape)

    config = CLIPConfig(
        text_config=dict(TEXT_G, eos_token_id=98),
        vision_config=VISION,
        projection_dim=24,
    )
    model = CLIPModel(config).eval()
    _randomise(model)
    model.save_pretrained(OUT / "model", safe_serialization=True)
    ids, mask = _ids(rng, 98)
    pixels = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        image = model.get_image_features(pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2))
        text = model.get_text_features(
            input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
        )
        if not isinstance(image, torch.Tensor):
            image, text = image.pooler_output, text.pooler_output
        # flow_grpo's pickscore_scorer.py, `PickScoreScorer.__call__`.
        image_embs = image / image.norm(p=2, dim=-1, keepdim=True)
        text_embs = text / text.norm(p=2, dim=-1, keepdim=True)
        scores = (model.logit_scale.exp() * (text_embs @ image_embs.T)).diag() / 26
    np.savez(
        OUT / "model" / "io.npz",
        pixels=pixels,
        ids=ids,
        mask=mask,
        image_features=image.numpy(),
        text_features=text.numpy(),
        pickscore=scores.numpy(),
    )
    print("model", scores.numpy())

    from PIL import Image

    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)
    record = {}
    for name, shape in (("square", (32, 32, 3)), ("wide", (40, 56, 3))):
        images = rng.uniform(0.0, 1.0, (2, *shape)).astype(np.float32)
        # flow_grpo's rewards.py: `(images * 255).round().clamp(0, 255).to(torch.uint8)`.
        eight = np.clip(np.round(images * 255), 0, 255).astype(np.uint8)
        pil = [Image.fromarray(image) for image in eight]
        pixels = processor(images=pil, return_tensors="np")["pixel_values"]
        record[name] = images
        record[f"{name}_pixels"] = pixels.transpose(0, 2, 3, 1)
        # flow_grpo's PickScore of these images for the prompts `ids`, end to end: the
        # processor's pixels through `get_image_features`, `pickscore_scorer.py`'s formula.
        with torch.no_grad():
            image = model.get_image_features(pixel_values=torch.from_numpy(pixels))
            if not isinstance(image, torch.Tensor):
                image = image.pooler_output
            image = image / image.norm(p=2, dim=-1, keepdim=True)
            record[f"{name}_pickscore"] = (
                (model.logit_scale.exp() * (text_embs @ image.T)).diag() / 26
            ).numpy()
    record["ids"], record["mask"] = ids, mask
    np.savez(OUT / "processor.npz", **record)
    print("processor", {k: v.shape for k, v in record.items()})

    full: dict[str, Any] = {}
    with torch.device("meta"):
        for name, make_model, config in (
            ("clip_l", CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_L)),
            ("clip_g", CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_G)),
            ("pickscore", CLIPModel, CLIPConfig(**PICKSCORE)),
        ):
            model = make_model(config)
            full[name] = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "keys": {k: list(v.shape) for k, v in model.state_dict().items()},
            }
            print(name, full[name]["parameters"])
    (OUT / "clip_keys.json").write_text(json.dumps(full, indent=0) + "\n")


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_clip_fixtures.py (no arguments)")
    make()
