"""Fixtures for the pipelines' prompt embeddings (`flowgrpo_eqx.models.SD3PromptEncoder`,
`FluxPromptEncoder`), made with diffusers' own `encode_prompt`.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch, transformers and diffusers:

    /tmp/venv-torch/bin/python tools/make_prompt_fixtures.py

It writes `tests/data/prompts/`, laid out as a pipeline's folder: tiny random text encoders
(`text_encoder/`: a `CLIPTextModelWithProjection` as SD3's CLIP-L, `quick_gelu` and the legacy
end-of-text rule; `text_encoder_2/`: one as OpenCLIP bigG, `gelu`; `text_encoder_3/`: a T5
v1.1 encoder; `flux_text_encoder/`: a `CLIPTextModel` without projection as FLUX's CLIP-L), and
word-level tokenizers made with the `tokenizers` package (`tokenizer/`: CLIP's start and
end-of-text tokens around the words, padded with end-of-text; `tokenizer_3/`: T5's `</s>`
after the words, padded with `<pad>`), each a `tokenizer.json` that transformers and the
`tokenizers` package both read. `io.npz` holds the prompts and what
`StableDiffusion3Pipeline.encode_prompt` (`sd3_context` `[B, 77 + 16, 48]`, `sd3_pooled`) and
`FluxPipeline.encode_prompt` (`flux_context` `[B, 16, 48]`, `flux_pooled`) and
`WanPipeline.encode_prompt` (`wan_context` `[B, 16, 40]`, from `wan_text_encoder/`: a tiny
random umT5 encoder) give for them, with `max_sequence_length=16`.
"""

import pathlib
import sys


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "prompts"
WORDS = ["a", "red", "blue", "green", "cube", "ball", "on", "the", "left", "right", "of", "two"]
PROMPTS = ["a red cube", "two green ball on the left of the blue cube", "a cube a cube a cube"]
LENGTH = 16


def make() -> None:
    import numpy as np
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        StableDiffusion3Pipeline,
        WanPipeline,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    torch.manual_seed(0)
    # CLIP: the end-of-text token has the largest id, as in CLIP's vocabulary (the legacy
    # pooling takes the largest id).
    clip_vocab = {"<|startoftext|>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    clip_vocab["<|endoftext|>"] = len(clip_vocab)
    end = clip_vocab["<|endoftext|>"]
    clip = Tokenizer(models.WordLevel(clip_vocab, unk_token="<|endoftext|>"))
    clip.pre_tokenizer = pre_tokenizers.Whitespace()
    clip.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", end)],
    )
    clip_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=clip,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=77,
    )
    t5_vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    t5 = Tokenizer(models.WordLevel(t5_vocab, unk_token="<unk>"))
    t5.pre_tokenizer = pre_tokenizers.Whitespace()
    t5.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    t5_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=t5, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    common = dict(
        vocab_size=len(clip_vocab),
        intermediate_size=40,
        num_hidden_layers=3,
        max_position_embeddings=77,
        layer_norm_eps=1e-5,
    )
    clip_l = CLIPTextModelWithProjection(
        CLIPTextConfig(
            **common,
            hidden_size=16,
            num_attention_heads=2,
            hidden_act="quick_gelu",
            eos_token_id=2,
            projection_dim=16,
        )
    ).eval()
    clip_g = CLIPTextModelWithProjection(
        CLIPTextConfig(
            **common,
            hidden_size=24,
            num_attention_heads=3,
            hidden_act="gelu",
            eos_token_id=end,
            projection_dim=24,
        )
    ).eval()
    flux_clip = CLIPTextModel(
        CLIPTextConfig(
            **common, hidden_size=16, num_attention_heads=2, hidden_act="quick_gelu", eos_token_id=2
        )
    ).eval()
    t5_model = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_vocab),
            d_model=48,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()
    umt5 = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(t5_vocab),
            d_model=40,
            d_kv=8,
            d_ff=56,
            num_layers=2,
            num_heads=5,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()
    with torch.no_grad():
        for model in (clip_l, clip_g, flux_clip, t5_model, umt5):
            for param in model.parameters():
                param.copy_(0.3 * torch.randn_like(param) + 0.02)
    for folder, model in (
        ("text_encoder", clip_l),
        ("text_encoder_2", clip_g),
        ("text_encoder_3", t5_model),
        ("flux_text_encoder", flux_clip),
        ("wan_text_encoder", umt5),
    ):
        model.save_pretrained(OUT / folder, safe_serialization=True)
    clip_tokenizer.save_pretrained(OUT / "tokenizer")
    t5_tokenizer.save_pretrained(OUT / "tokenizer_3")

    scheduler = FlowMatchEulerDiscreteScheduler()
    sd3 = StableDiffusion3Pipeline(
        transformer=None,
        scheduler=scheduler,
        vae=None,
        text_encoder=clip_l,
        tokenizer=clip_tokenizer,
        text_encoder_2=clip_g,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=t5_model,
        tokenizer_3=t5_tokenizer,
    )
    flux = FluxPipeline(
        transformer=None,
        scheduler=scheduler,
        vae=None,
        text_encoder=flux_clip,
        tokenizer=clip_tokenizer,
        text_encoder_2=t5_model,
        tokenizer_2=t5_tokenizer,
    )
    wan = WanPipeline(
        tokenizer=t5_tokenizer, text_encoder=umt5, transformer=None, vae=None, scheduler=scheduler
    )
    with torch.no_grad():
        wan_context, _ = wan.encode_prompt(
            prompt=PROMPTS,
            do_classifier_free_guidance=False,
            device="cpu",
            max_sequence_length=LENGTH,
        )
        sd3_context, _, sd3_pooled, _ = sd3.encode_prompt(
            prompt=PROMPTS,
            prompt_2=None,
            prompt_3=None,
            device="cpu",
            do_classifier_free_guidance=False,
            max_sequence_length=LENGTH,
        )
        flux_context, flux_pooled, _ = flux.encode_prompt(
            prompt=PROMPTS, prompt_2=None, device="cpu", max_sequence_length=LENGTH
        )
    np.savez(
        OUT / "io.npz",
        prompts=np.asarray(PROMPTS),
        sd3_context=sd3_context.numpy(),
        sd3_pooled=sd3_pooled.numpy(),
        flux_context=flux_context.numpy(),
        flux_pooled=flux_pooled.numpy(),
        wan_context=wan_context.numpy(),
    )
    print("sd3", tuple(sd3_context.shape), tuple(sd3_pooled.shape))
    print("flux", tuple(flux_context.shape), tuple(flux_pooled.shape))


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_prompt_fixtures.py (no arguments)")
    make()
