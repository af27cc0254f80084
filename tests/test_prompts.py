"""The pipelines' prompt embeddings in JAX against diffusers' `encode_prompt`, tokenized by the
`tokenizers` package from the pipelines' tokenizer files, without torch or transformers.

The fixtures under `tests/data/prompts/` were made by diffusers itself
(`tools/make_prompt_fixtures.py`, run by hand with torch, transformers and diffusers): tiny
random text encoders and word-level tokenizers laid out as a pipeline, and what
`StableDiffusion3Pipeline.encode_prompt` and `FluxPipeline.encode_prompt` give for three
prompts.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import (
    CLIPTextModel,
    FluxPromptEncoder,
    PromptTokenizer,
    SD3PromptEncoder,
    T5Encoder,
    WanPromptEncoder,
    load_clip,
    load_t5,
)
from tests.diffusers_helpers import relative
from tests.tolerances import reference_model_rtol


PROMPTS = pathlib.Path(__file__).resolve().parent / "data" / "prompts"
# Installed with the project's dev extra (CI) and carried to the TPU (tools/tpu/run.sh); an
# environment without the `encoders` extra skips these tests by name.
pytest.importorskip("tokenizers", reason="PromptTokenizer reads tokenizer.json with it")


def _clip(name: str) -> CLIPTextModel:
    model = load_clip(PROMPTS / name)
    assert isinstance(model, CLIPTextModel)
    return model


@pytest.fixture(scope="module")
def io() -> dict[str, np.ndarray]:
    return dict(np.load(PROMPTS / "io.npz"))


@pytest.fixture(scope="module")
def t5() -> T5Encoder:
    return load_t5(PROMPTS / "text_encoder_3")


def test_sd3_prompt_embeddings_are_encode_prompts(io: dict[str, np.ndarray], t5: T5Encoder) -> None:
    prompts = [str(p) for p in io["prompts"]]
    clip_ids = PromptTokenizer(PROMPTS / "tokenizer", 77)(prompts)
    t5_ids = PromptTokenizer(PROMPTS / "tokenizer_3", 16)(prompts)
    encoder = SD3PromptEncoder(_clip("text_encoder"), _clip("text_encoder_2"), t5)
    cond = jax.vmap(encoder)(jnp.asarray(clip_ids), jnp.asarray(clip_ids), jnp.asarray(t5_ids))
    rtol = reference_model_rtol()
    assert cond["context"].shape == io["sd3_context"].shape == (3, 77 + 16, 48)
    assert relative(np.asarray(cond["context"]), io["sd3_context"]) < rtol
    assert relative(np.asarray(cond["pooled"]), io["sd3_pooled"]) < rtol


def test_flux_prompt_embeddings_are_encode_prompts(
    io: dict[str, np.ndarray], t5: T5Encoder
) -> None:
    prompts = [str(p) for p in io["prompts"]]
    clip_ids = PromptTokenizer(PROMPTS / "tokenizer", 77)(prompts)
    t5_ids = PromptTokenizer(PROMPTS / "tokenizer_3", 16)(prompts)
    encoder = FluxPromptEncoder(_clip("flux_text_encoder"), t5)
    cond = jax.vmap(encoder)(jnp.asarray(clip_ids), jnp.asarray(t5_ids))
    rtol = reference_model_rtol()
    assert relative(np.asarray(cond["context"]), io["flux_context"]) < rtol
    assert relative(np.asarray(cond["pooled"]), io["flux_pooled"]) < rtol


def test_the_tokenizer_pads_and_truncates_to_its_length() -> None:
    clip = PromptTokenizer(PROMPTS / "tokenizer", 6)
    ids = clip(["a red cube", "two green ball on the left of the blue cube"])
    assert ids.shape == (2, 6) and ids.dtype == np.int32
    end = int(ids[0, 4])
    assert list(ids[0, 4:]) == [end, end]  # padded with the end-of-text token
    assert ids[1, -1] == end  # truncated, the end-of-text token kept last
    t5 = PromptTokenizer(PROMPTS / "tokenizer_3", 8)(["a red cube"])
    assert list(t5[0, 3:]) == [1, 0, 0, 0, 0]  # </s>, then <pad>


def test_a_clip_tower_without_projection_is_refused_by_name(t5: T5Encoder) -> None:
    plain = _clip("flux_text_encoder")
    with pytest.raises(ValueError, match="`clip_g`"):
        SD3PromptEncoder(_clip("text_encoder"), plain, t5)


def test_a_folder_without_tokenizer_json_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="`path`"):
        PromptTokenizer(tmp_path, 77)
    with pytest.raises(ValueError, match="`length`"):
        PromptTokenizer(PROMPTS / "tokenizer", 0)


def test_wan_prompt_embeddings_are_encode_prompts(io: dict[str, np.ndarray]) -> None:
    prompts = [str(p) for p in io["prompts"]]
    tokenizer = PromptTokenizer(PROMPTS / "tokenizer_3", 16)
    ids, mask = tokenizer.encode(prompts)
    np.testing.assert_array_equal(ids, tokenizer(prompts))
    assert list(mask[0]) == [1] * 4 + [0] * 12  # "a red cube" and </s>
    encoder = WanPromptEncoder(load_t5(PROMPTS / "wan_text_encoder"))
    assert encoder.t5.encoder.block[1].layer[0].SelfAttention.relative_attention_bias is not None
    context = np.asarray(jax.vmap(encoder)(jnp.asarray(ids), jnp.asarray(mask)))
    assert relative(context, io["wan_context"]) < reference_model_rtol()
    assert np.all(context[0, 4:] == 0)
