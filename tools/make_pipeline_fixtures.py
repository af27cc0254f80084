"""Tiny random pipelines in the layouts SD3.5, FLUX.1-dev, FLUX.1-schnell, Wan 2.1 T2V and
PickScore publish, made with diffusers and transformers themselves, and what diffusers computes
with them end to end.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch, diffusers, transformers, tokenizers and sentencepiece (diffusers
0.42.1, transformers 5.25.0, torch 2.13.0 CPU; `ftfy` is not installed, so `WanPipeline`'s
prompt cleaning is `html.unescape` and collapsed whitespace); nothing is downloaded:

    /tmp/venv-torch/bin/python tools/make_pipeline_fixtures.py make

It writes `tests/data/pipelines/`, each folder what the pipeline's `save_pretrained` writes
(`model_index.json`, each component's folder), with the tokenizers in the published layouts
(CLIP's `vocab.json` + `merges.txt` without `tokenizer.json`, written as
`tools/make_tokenizer_fixtures.py` writes them, on the same learned vocabulary; T5's
`tokenizer.json` as `T5TokenizerFast.save_pretrained` writes it, and its `spiece.model`
beside it, as published). Every weight is drawn at random (none left at 0 or 1):

- `sd35/`: `StableDiffusion3Pipeline` with an SD3.5-style `SD3Transformer2DModel` (RMS
    qk-norm, the first of two blocks with dual attention, 16 x 16 images), an
    `AutoencoderKL` with SD3's 16-channel latent, shift and scale factors (two levels: the
    latent is half the image's size), `text_encoder`/`text_encoder_2` tiny
    `CLIPTextModelWithProjection`s (CLIP-L: `quick_gelu`, the legacy `eos_token_id` 2;
    CLIP-G: `gelu`, the end-of-text id), `text_encoder_3` a tiny `T5EncoderModel`,
    `tokenizer`/`tokenizer_2` CLIP folders (CLIP-G padded with `!`), `tokenizer_3` a T5
    folder, `scheduler` `FlowMatchEulerDiscreteScheduler(shift=3.0)`;
- `flux_dev/` and `flux_schnell/`: `FluxPipeline` with a `FluxTransformer2DModel` (one
    double- and one single-stream block; guidance embedding for dev only; 16 x 16 images),
    a CLIP-L
    `CLIPTextModel` `text_encoder`, a T5 `text_encoder_2`, the 16-channel `AutoencoderKL` with
    FLUX's shift and scale factors, `FlowMatchEulerDiscreteScheduler` with FLUX.1-dev's
    dynamic shifting configuration or FLUX.1-schnell's (shift 1, no dynamic shifting);
- `wan/`: `WanPipeline` with a `WanTransformer3DModel`, an `AutoencoderKLWan` (4x in time,
    8x in space; 5 frames of 32 x 32), a `UMT5EncoderModel` text encoder and its tokenizer
    (umT5's special pieces, 300 `extra_ids`), and the scheduler
    `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`'s
    `model_index.json` names, `UniPCMultistepScheduler` with its flow settings
    (`prediction_type="flow_prediction"`, `use_flow_sigmas=True`, `flow_shift=3.0`; from that
    repository's `scheduler/scheduler_config.json` as we know it, not read from the hub
    here);
- `rewards/pickscore/`: a tiny `CLIPModel` (`config.json` + `model.safetensors`, as
    `tests/data/clip/model`) whose text vocabulary is the CLIP fixture's, and `processor/`:
    the CLIP tokenizer files as published (`vocab.json`, `merges.txt`, an older
    transformers' `tokenizer_config.json` and `special_tokens_map.json`) and
    `preprocessor_config.json` (`CLIPImageProcessor`: shortest side 32, centre crop 32,
    OpenAI's mean and std). PickScore loads the model from one folder and the processor from
    another.

Beside each pipeline folder (not inside it), `<name>_io.npz` and `<name>_io.json`:

- for the two prompts `PROMPTS`, what `pipe.encode_prompt(...)` gives with
    `max_sequence_length=16`, and the empty negative prompt's embeddings where the pipeline
    uses classifier-free guidance (SD3.5, Wan): `prompt_embeds`, `pooled_prompt_embeds`,
    `negative_prompt_embeds`, `negative_pooled_prompt_embeds`;
- the ids and attention masks each tokenizer gave, called as the pipeline calls it
    (`ids_<tokenizer folder>`, `mask_<...>`, and `negative_ids_<...>` for the empty prompt;
    Wan's after its prompt cleaning);
- the fixed initial `latents` passed (SD3.5's `[B, 16, 8, 8]`; FLUX's packed as
    `FluxPipeline` takes them, `[B, 16, 64]`, from `latents_unpacked` `[B, 16, 8, 8]` by
    `FluxPipeline._pack_latents`; Wan's `[B, 4, 2, 4, 4]`), and the pipeline's output for
    `num_inference_steps=2` with `output_type="latent"` (`output_latent`: SD3.5's and Wan's
    latents before decoding, FLUX's packed) and `output_type="np"` (`output_np`: images
    `[B, 16, 16, 3]`, Wan's video `[B, 5, 32, 32, 3]`, in `[0, 1]`), and the scheduler's
    `timesteps` and `sigmas` of the run;
- the JSON: every argument passed to `encode_prompt` and to the pipeline's call (guidance
    4.5 for SD3.5, 3.5 for FLUX.1-dev, 0 for schnell, which takes no guidance, 5.0 for Wan
    with 5 frames), the arrays' shapes, and the versions.

`rewards/pickscore_io.npz`: the prompts' ids and masks by the processor (`padding=
"max_length"`, 77), the model's `get_text_features`, an image in `[-1, 1]` (`image`, 32 x 32),
the processor's `pixel_values` of it (channels-last) after flow_grpo's conversion to 8 bits,
`get_image_features`, and flow_grpo's PickScore of the image for each prompt.
"""

import json
import pathlib
import shutil
import sys
import tempfile
from typing import Any


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_tokenizer_fixtures as tokenizer_fixtures  # noqa: E402


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "pipelines"
PROMPTS = ["a photo of a cat", "A red cube on the left of a blue sphere, highly detailed!"]
LENGTH = 16  # max_sequence_length
STEPS = 2
SIZE = 16  # SD3.5's and FLUX's images, pixels
WAN_SIZE = 32  # Wan's frames, pixels (its autoencoder is 8x in space)
PICKSCORE_SIZE = 32  # the PickScore fixture's image tower
FRAMES = 5
T5_PIECES = 300  # the T5 tokenizers' SentencePiece vocabulary (before the sentinels)

CLIP_L = dict(
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    eos_token_id=2,  # SD3's and FLUX's CLIP-L: the legacy rule, the largest id ends the text
)
CLIP_G = dict(CLIP_L, hidden_size=16, intermediate_size=32, hidden_act="gelu")
T5 = dict(
    d_model=24,
    d_kv=6,
    d_ff=32,
    num_layers=2,
    num_heads=4,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    is_encoder_decoder=False,
    use_cache=False,
)
UMT5 = dict(T5, d_model=16, d_kv=4, d_ff=24)
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[4, 8],
    layers_per_block=1,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=4,
    sample_size=SIZE,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)
SD3_VAE = dict(VAE, scaling_factor=1.5305, shift_factor=0.0609)
FLUX_VAE = dict(VAE, scaling_factor=0.3611, shift_factor=0.1159)
SD35_TRANSFORMER = dict(
    sample_size=SIZE // 2,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=T5["d_model"],
    caption_projection_dim=16,
    pooled_projection_dim=8 + 16,  # CLIP-L's and CLIP-G's projections side by side
    out_channels=16,
    pos_embed_max_size=12,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=T5["d_model"],
    pooled_projection_dim=CLIP_L["hidden_size"],
    axes_dims_rope=(2, 2, 4),
)
# black-forest-labs/FLUX.1-dev's and FLUX.1-schnell's scheduler/scheduler_config.json.
FLUX_DEV_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
FLUX_SCHNELL_SCHEDULER = dict(FLUX_DEV_SCHEDULER, shift=1.0, use_dynamic_shifting=False)
WAN_VAE = dict(
    base_dim=2,
    z_dim=4,
    dim_mult=[1, 1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    latents_mean=[0.3, -0.2, 0.1, -0.4],
    latents_std=[1.5, 0.7, 2.1, 1.2],
)
WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=UMT5["d_model"],
    freq_dim=256,
    ffn_dim=16,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, scheduler/scheduler_config.json (its flow settings).
WAN_SCHEDULER = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
)
PICKSCORE_TEXT = dict(CLIP_G, hidden_size=16)
PICKSCORE_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=PICKSCORE_SIZE,
    patch_size=8,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)


def _randomise(model: Any, seed: int, gain: float = 1.0) -> None:
    """Every parameter drawn at random, none at 0 or 1: norm weights near 1, matrices scaled
    by their fan-in, biases small."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 0:
                param.fill_(2.3)  # CLIP's logit scale: a temperature of exp(2.3)
            elif param.ndim == 1 and ("norm" in name or name.endswith("gamma")):
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:
                param.copy_(0.05 * noise + 0.01)
            else:
                fan_in = param[0].numel()
                param.copy_(gain * noise / fan_in**0.5 + 0.01)


def _clip_tokenizers(tmp: pathlib.Path) -> tuple[Any, Any, int]:
    from transformers import CLIPTokenizer

    tokenizer_fixtures.write_clip_folder(tmp / "clip_l", "<|endoftext|>", legacy=False)
    tokenizer_fixtures.write_clip_folder(tmp / "clip_g", "!", legacy=False)
    clip_l = CLIPTokenizer.from_pretrained(tmp / "clip_l")
    return clip_l, CLIPTokenizer.from_pretrained(tmp / "clip_g"), len(clip_l)


def _t5_tokenizer(tmp: pathlib.Path, *, umt5: bool) -> Any:
    from transformers import T5TokenizerFast

    name = "umt5" if umt5 else "t5"
    model = tokenizer_fixtures.sentencepiece_model(
        umt5=umt5, small_rules=True, vocab_size=T5_PIECES
    )
    tokenizer_fixtures.write_t5_folder(tmp / name, model, 300 if umt5 else 100, legacy=False)
    return T5TokenizerFast.from_pretrained(tmp / name)


def _published_tokenizers(folder: pathlib.Path, tmp: pathlib.Path, clip: dict[str, str]) -> None:
    """The tokenizer folders as published: CLIP's without `tokenizer.json` (written in
    place of what `save_pretrained` wrote), T5's with `spiece.model` beside `tokenizer.json`."""
    for name, pad in clip.items():
        tokenizer_fixtures.write_clip_folder(folder / name, pad, legacy=False)
    for sub in folder.iterdir():
        config = sub / "tokenizer_config.json"
        if config.exists() and json.loads(config.read_text()).get("extra_ids") is not None:
            source = "umt5" if json.loads(config.read_text())["extra_ids"] == 300 else "t5"
            shutil.copy(tmp / source / "spiece.model", sub / "spiece.model")


def _text_models(vocab: int, t5_vocab: int, *, flux: bool) -> dict[str, Any]:
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    t5 = T5EncoderModel(T5Config(vocab_size=t5_vocab, **T5)).eval()
    _randomise(t5, 3, gain=1.5)
    if flux:
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=vocab, **CLIP_L)).eval()
        _randomise(clip, 1, gain=1.5)
        return {"text_encoder": clip, "text_encoder_2": t5}
    clip_l = CLIPTextModelWithProjection(
        CLIPTextConfig(vocab_size=vocab, projection_dim=8, **CLIP_L)
    ).eval()
    clip_g = CLIPTextModelWithProjection(
        CLIPTextConfig(vocab_size=vocab, projection_dim=16, **{**CLIP_G, "eos_token_id": vocab - 1})
    ).eval()
    _randomise(clip_l, 1, gain=1.5)
    _randomise(clip_g, 2, gain=1.5)
    return {"text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": t5}


def _ids(tokenizer: Any, prompts: list[str], length: int) -> dict[str, Any]:
    import numpy as np

    out = tokenizer(prompts, padding="max_length", max_length=length, truncation=True)
    return {
        "ids": np.asarray(out["input_ids"], np.int32),
        "mask": np.asarray(out["attention_mask"], np.int32),
    }


def _record(
    name: str,
    arrays: dict[str, Any],
    arguments: dict[str, Any],
    scheduler: Any,
) -> None:
    import diffusers
    import numpy as np
    import torch
    import transformers

    arrays = {
        key: value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        for key, value in arrays.items()
    }
    arrays["timesteps"] = scheduler.timesteps.numpy()
    arrays["sigmas"] = np.asarray(scheduler.sigmas)
    np.savez_compressed(OUT / f"{name}_io.npz", **arrays)
    record = {
        "prompts": PROMPTS,
        "pipeline": f"from_pretrained(tests/data/pipelines/{name}), float32, on the CPU",
        "arguments": {
            **arguments,
            "call": {
                **arguments["call"],
                "latents": "the npz's `latents` (a copy for each call)",
                "output_type": "'latent' gives `output_latent`, 'np' gives `output_np`",
            },
            "encode_prompt_device": "cpu",
        },
        "shapes": {key: list(value.shape) for key, value in arrays.items()},
        "versions": {
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }
    (OUT / f"{name}_io.json").write_text(json.dumps(record, indent=1) + "\n")
    print(name, {key: list(value.shape) for key, value in arrays.items()})


def _run(pipe: Any, call: dict[str, Any], latents: Any) -> dict[str, Any]:
    """The pipeline's output for `call`, as latents and as NumPy images, from `latents`."""
    with torch_no_grad():
        latent = pipe(**call, latents=latents.clone(), output_type="latent")
        images = pipe(**call, latents=latents.clone(), output_type="np")
    key = "frames" if hasattr(latent, "frames") else "images"
    return {"output_latent": getattr(latent, key), "output_np": getattr(images, key)}


def torch_no_grad() -> Any:
    import torch

    return torch.no_grad()


def make_sd35(tmp: pathlib.Path) -> None:
    import numpy as np
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    clip_l, clip_g, vocab = _clip_tokenizers(tmp)
    t5 = _t5_tokenizer(tmp, umt5=False)
    transformer = SD3Transformer2DModel(**SD35_TRANSFORMER).eval()
    vae = AutoencoderKL(**SD3_VAE).eval()
    _randomise(transformer, 4, gain=0.5)
    _randomise(vae, 5, gain=0.5)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        tokenizer=clip_l,
        tokenizer_2=clip_g,
        tokenizer_3=t5,
        **_text_models(vocab, len(t5), flux=False),
    )
    folder = OUT / "sd35"
    pipe.save_pretrained(folder)
    _published_tokenizers(folder, tmp, {"tokenizer": "<|endoftext|>", "tokenizer_2": "!"})
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)

    encode = dict(
        prompt=PROMPTS,
        prompt_2=None,
        prompt_3=None,
        device="cpu",
        num_images_per_prompt=1,
        do_classifier_free_guidance=True,
        negative_prompt=None,
        max_sequence_length=LENGTH,
    )
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(**encode)
    arrays: dict[str, Any] = {
        "prompt_embeds": embeds,
        "negative_prompt_embeds": negative,
        "pooled_prompt_embeds": pooled,
        "negative_pooled_prompt_embeds": negative_pooled,
    }
    for sub, tokenizer, length in (
        ("tokenizer", pipe.tokenizer, 77),
        ("tokenizer_2", pipe.tokenizer_2, 77),
        ("tokenizer_3", pipe.tokenizer_3, LENGTH),
    ):
        for prefix, prompts in (("", PROMPTS), ("negative_", ["", ""])):
            ids = _ids(tokenizer, prompts, length)
            arrays[f"{prefix}ids_{sub}"], arrays[f"{prefix}mask_{sub}"] = ids["ids"], ids["mask"]
    rng = np.random.default_rng(0)
    latents = torch.from_numpy(
        rng.standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32)
    )
    call = dict(
        prompt=PROMPTS,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.5,
        max_sequence_length=LENGTH,
    )
    arrays |= {"latents": latents, **_run(pipe, call, latents)}
    encode.pop("device")
    _record("sd35", arrays, {"encode_prompt": encode, "call": call}, pipe.scheduler)


def make_flux(tmp: pathlib.Path, name: str, *, dev: bool) -> None:
    import numpy as np
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    clip_l, _, vocab = _clip_tokenizers(tmp)
    t5 = _t5_tokenizer(tmp, umt5=False)
    transformer = FluxTransformer2DModel(**FLUX_TRANSFORMER, guidance_embeds=dev).eval()
    vae = AutoencoderKL(**FLUX_VAE).eval()
    _randomise(transformer, 6, gain=0.5)
    _randomise(vae, 5, gain=0.5)  # SD3.5's VAE weights: the same file, stored once by git
    scheduler = FLUX_DEV_SCHEDULER if dev else FLUX_SCHNELL_SCHEDULER
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        vae=vae,
        tokenizer=clip_l,
        tokenizer_2=t5,
        **_text_models(vocab, len(t5), flux=True),
    )
    folder = OUT / name
    pipe.save_pretrained(folder)
    _published_tokenizers(folder, tmp, {"tokenizer": "<|endoftext|>"})
    pipe = FluxPipeline.from_pretrained(folder)

    encode = dict(
        prompt=PROMPTS,
        prompt_2=None,
        device="cpu",
        num_images_per_prompt=1,
        max_sequence_length=LENGTH,
    )
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(**encode)
    arrays: dict[str, Any] = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    for sub, tokenizer, length in (
        ("tokenizer", pipe.tokenizer, 77),
        ("tokenizer_2", pipe.tokenizer_2, LENGTH),
    ):
        ids = _ids(tokenizer, PROMPTS, length)
        arrays[f"ids_{sub}"], arrays[f"mask_{sub}"] = ids["ids"], ids["mask"]
    rng = np.random.default_rng(1)
    unpacked = torch.from_numpy(
        rng.standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32)
    )
    latents = FluxPipeline._pack_latents(unpacked, 2, 16, SIZE // 2, SIZE // 2)
    call = dict(
        prompt=PROMPTS,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=3.5 if dev else 0.0,
        max_sequence_length=LENGTH,
    )
    arrays |= {"latents": latents, "latents_unpacked": unpacked, **_run(pipe, call, latents)}
    encode.pop("device")
    _record(name, arrays, {"encode_prompt": encode, "call": call}, pipe.scheduler)


def make_wan(tmp: pathlib.Path) -> None:
    import numpy as np
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer(tmp, umt5=True)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **UMT5)).eval()
    transformer = WanTransformer3DModel(**WAN_TRANSFORMER).eval()
    vae = AutoencoderKLWan(**WAN_VAE).eval()
    _randomise(text_encoder, 8, gain=1.5)
    _randomise(transformer, 9)
    _randomise(vae, 10, gain=0.6)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER),
    )
    folder = OUT / "wan"
    pipe.save_pretrained(folder)
    _published_tokenizers(folder, tmp, {})
    pipe = WanPipeline.from_pretrained(folder)

    encode = dict(
        prompt=PROMPTS,
        negative_prompt=None,
        do_classifier_free_guidance=True,
        num_videos_per_prompt=1,
        max_sequence_length=LENGTH,
        device="cpu",
    )
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(**encode)
    arrays: dict[str, Any] = {"prompt_embeds": embeds, "negative_prompt_embeds": negative}
    cleaned = [prompt_clean(prompt) for prompt in PROMPTS]
    for prefix, prompts in (("", cleaned), ("negative_", ["", ""])):
        ids = _ids(pipe.tokenizer, prompts, LENGTH)
        arrays[f"{prefix}ids_tokenizer"], arrays[f"{prefix}mask_tokenizer"] = (
            ids["ids"],
            ids["mask"],
        )
    rng = np.random.default_rng(2)
    latent_frames = (FRAMES - 1) // 4 + 1
    latents = torch.from_numpy(
        rng.standard_normal((2, 4, latent_frames, WAN_SIZE // 8, WAN_SIZE // 8)).astype(np.float32)
    )
    call = dict(
        prompt=PROMPTS,
        negative_prompt=None,
        height=WAN_SIZE,
        width=WAN_SIZE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        max_sequence_length=LENGTH,
    )
    arrays |= {"latents": latents, **_run(pipe, call, latents)}
    encode.pop("device")
    _record("wan", arrays, {"encode_prompt": encode, "call": call}, pipe.scheduler)


def make_pickscore(tmp: pathlib.Path) -> None:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    folder = OUT / "rewards" / "pickscore"
    processor_folder = OUT / "rewards" / "processor"
    tokenizer_fixtures.write_clip_folder(processor_folder, "<|endoftext|>", legacy=True)
    CLIPImageProcessor(
        size={"shortest_edge": PICKSCORE_SIZE},
        crop_size={"height": PICKSCORE_SIZE, "width": PICKSCORE_SIZE},
    ).save_pretrained(processor_folder)
    processor = CLIPProcessor.from_pretrained(processor_folder)
    vocab = len(processor.tokenizer)
    config = CLIPConfig(
        text_config=dict(vocab_size=vocab, **{**PICKSCORE_TEXT, "eos_token_id": vocab - 1}),
        vision_config=PICKSCORE_VISION,
        projection_dim=16,
    )
    model = CLIPModel(config).eval()
    _randomise(model, 11, gain=1.5)
    model.save_pretrained(folder)
    model = CLIPModel.from_pretrained(folder).eval()

    rng = np.random.default_rng(3)
    image = rng.uniform(-1.0, 1.0, (PICKSCORE_SIZE, PICKSCORE_SIZE, 3)).astype(np.float32)
    # flow_grpo's pickscore_scorer.py: the image to 8 bits, a PIL image, the processor.
    pil = Image.fromarray((((image + 1) / 2).clip(0, 1) * 255).round().astype(np.uint8))
    text = processor(
        text=PROMPTS, padding="max_length", truncation=True, max_length=77, return_tensors="pt"
    )
    pixels = processor(images=[pil], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        text_features = model.get_text_features(**text)
        image_features = model.get_image_features(pixel_values=pixels)
        if not isinstance(text_features, torch.Tensor):  # transformers 5: an output object
            text_features, image_features = (
                text_features.pooler_output,
                image_features.pooler_output,
            )
        t = text_features / text_features.norm(dim=-1, keepdim=True)
        i = image_features / image_features.norm(dim=-1, keepdim=True)
        score = model.logit_scale.exp() * (t @ i.T)[:, 0] / 26
    np.savez_compressed(
        OUT / "rewards" / "pickscore_io.npz",
        prompts=np.asarray(PROMPTS),
        ids=text["input_ids"].numpy().astype(np.int32),
        mask=text["attention_mask"].numpy().astype(np.int32),
        text_features=text_features.numpy(),
        image=image,
        pixels=pixels.permute(0, 2, 3, 1).numpy(),
        image_features=image_features.numpy(),
        pickscore=score.numpy(),
    )
    print("pickscore", score.numpy())


def make() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_sd35(pathlib.Path(tmp) / "sd35")
        make_flux(pathlib.Path(tmp) / "flux_dev", "flux_dev", dev=True)
        make_flux(pathlib.Path(tmp) / "flux_schnell", "flux_schnell", dev=False)
        make_wan(pathlib.Path(tmp) / "wan")
        make_pickscore(pathlib.Path(tmp) / "pickscore")
    total = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file())
    print(f"tests/data/pipelines: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    if sys.argv[1:] != ["make"]:
        sys.exit("usage: python tools/make_pipeline_fixtures.py make")
    make()
