"""Prompt embeddings as the SD3, SD3.5, FLUX.1 and Wan 2.1 pipelines build them, from our
text encoders: what diffusers' `StableDiffusion3Pipeline.encode_prompt`,
`FluxPipeline.encode_prompt` and `WanPipeline.encode_prompt` give, computed in JAX, and the
pipelines' tokenization with the `tokenizers` package.
"""

import pathlib
from collections.abc import Sequence
from typing import final

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._misc import check_int
from ._clip import CLIPTextModel
from ._flux import FluxCondition
from ._mmdit import MMDiTCondition
from ._t5 import T5Encoder


@final
class PromptTokenizer:
    """A pipeline's tokenizer folder, read with the `tokenizers` package (no transformers):
    prompts to token ids padded to a fixed length and truncated to it, as the pipelines call
    their tokenizers (`padding="max_length"`, `truncation=True`), with transformers' ids.

    The folder is read in the first layout it holds: `tokenizer.json` (read as it is);
    CLIP's `vocab.json` + `merges.txt` (SD3's and FLUX.1's CLIP tokenizers, PickScore's
    processor, as published: built as transformers' `CLIPTokenizer` builds them); T5's or
    umT5's `spiece.model` (built as transformers' `T5TokenizerFast` builds it, with the
    `extra_ids` sentinels). `tokenizer_config.json` (or `special_tokens_map.json`) names the
    special tokens and the padding token (CLIP's default `<|endoftext|>`, T5's `<pad>`).

    As transformers 5's `T5TokenizerFast` does, a `spiece.model` folder gives a piece outside
    the vocabulary id 2 whatever the model's own unknown id (2 in T5's, 3 in an umT5-like
    model, where SentencePiece itself gives 3). A `tokenizer.json` is read as it is: one
    written by transformers 4 keeps its unknown id, where transformers 5 would rebuild the
    tokenizer from its vocabulary and give 2.

    **Arguments:**

    - `path`: the folder (a pipeline's `tokenizer/`, `tokenizer_2/` or `tokenizer_3/`).
    - `length`: the ids' length (77 for CLIP; the pipeline's `max_sequence_length`, 256 in
        SD3's and 512 in FLUX.1-dev's, for T5).

    **Raises:**

    - `ValueError`: naming `length` when it is not a positive int; naming `path` when the
        folder holds none of the files above (the message lists them), or only one of
        `vocab.json` and `merges.txt`, or names no padding token; naming the file that is
        not JSON, not a tokenizer file, not a SentencePiece model, or that names a padding
        token (or start or end token) not in the vocabulary.
    - `ImportError`: naming the `tokenizers` package when it is not installed.
    """

    def __init__(self, path: str | pathlib.Path, length: int) -> None:
        check_int("length", length, 1)
        try:
            from ._tokenizer_files import read_tokenizer
        except ImportError as error:  # pragma: no cover - the package is a dependency of dev
            raise ImportError(
                "PromptTokenizer reads tokenizer files with the `tokenizers` package, which the "
                "`encoders` extra of flowgrpo_eqx installs."
            ) from error
        folder = pathlib.Path(path)
        self._tokenizer, pad = read_tokenizer(folder)
        if pad is None:
            raise ValueError(
                f"`path` ({folder}) names no pad_token (tokenizer_config.json or "
                "special_tokens_map.json) and its tokenizer.json sets no padding."
            )
        pad_id = self._tokenizer.token_to_id(pad)
        if pad_id is None:
            raise ValueError(
                f"`path` ({folder}): the pad_token {pad!r} of tokenizer_config.json (or "
                "special_tokens_map.json) is not in the vocabulary."
            )
        self._tokenizer.enable_truncation(length)
        self._tokenizer.enable_padding(length=length, pad_id=pad_id, pad_token=pad)
        self.length = length

    def __call__(self, prompts: Sequence[str]) -> np.ndarray:
        """The token ids of `prompts`.

        **Arguments:**

        - `prompts`: the prompts (a list or tuple of strings, not one string).

        **Returns:**

        `[len(prompts), length]` int32.

        **Raises:**

        - `ValueError`: naming `prompts` when it is one string, or when a prompt is not a
            string or is not valid Unicode (a lone surrogate).
        """
        return self.encode(prompts)[0]

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The token ids of `prompts` and their attention masks, from one tokenization.

        **Arguments:**

        - `prompts`: the prompts (a list or tuple of strings, not one string).

        **Returns:**

        `(ids, mask)`, each `[len(prompts), length]` int32; the mask is 1 for the prompts'
        tokens and 0 for the padding.

        **Raises:**

        - `ValueError`: naming `prompts` when it is one string, or when a prompt is not a
            string or is not valid Unicode (a lone surrogate).
        """
        texts = _check_prompts(prompts)
        encodings = self._tokenizer.encode_batch(texts)
        shape = (len(texts), self.length)
        ids: np.ndarray = np.asarray([e.ids for e in encodings], np.int32).reshape(shape)
        mask: np.ndarray = np.asarray([e.attention_mask for e in encodings], np.int32)
        return ids, mask.reshape(shape)


def _check_prompts(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str | bytes):
        raise ValueError(
            f"`prompts` must be a list of strings, got one {type(prompts).__name__} "
            f"({prompts[:40]!r}); wrap a single prompt in a list."
        )
    if not isinstance(prompts, Sequence):
        raise ValueError(f"`prompts` must be a list of strings, got {type(prompts).__name__}.")
    texts = list(prompts)
    for index, prompt in enumerate(texts):
        if not isinstance(prompt, str):
            raise ValueError(
                f"`prompts[{index}]` must be a string, got {type(prompt).__name__} ({prompt!r})."
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"`prompts[{index}]` is not valid Unicode ({error.reason} at {error.start})."
            ) from error
    return texts


@final
class SD3PromptEncoder(eqx.Module):
    """SD3's and SD3.5's three text encoders and how the pipeline joins their outputs:
    `StableDiffusion3Pipeline.encode_prompt` without classifier-free guidance.

    The `context` is both CLIP towers' penultimate hidden states side by side (77 tokens,
    768 + 1280 wide in SD3), zero-padded to T5's width, followed by T5's states; the `pooled`
    is both towers' projected pooled states side by side (2048 in SD3). The result is the
    `MMDiTCondition` an `MMDiT` takes. vmap it over a batch of prompts.

    **Arguments:**

    - `clip_l`: the pipeline's `text_encoder` (a `CLIPTextModel` with a projection).
    - `clip_g`: its `text_encoder_2` (likewise).
    - `t5`: its `text_encoder_3`.

    **Raises:**

    - `ValueError`: naming `clip_l` or `clip_g` when it has no projection.
    """

    clip_l: CLIPTextModel
    clip_g: CLIPTextModel
    t5: T5Encoder

    def __check_init__(self) -> None:
        for name in ("clip_l", "clip_g"):
            if getattr(self, name).text_projection is None:
                raise ValueError(
                    f"`{name}` must have a text projection (CLIPTextModelWithProjection)."
                )

    def __call__(
        self,
        clip_l_ids: Int[Array, " 77"],
        clip_g_ids: Int[Array, " 77"],
        t5_ids: Int[Array, " T"],
    ) -> MMDiTCondition:
        """The condition of one prompt.

        **Arguments:**

        - `clip_l_ids`, `clip_g_ids`: the prompt's ids from `tokenizer` and `tokenizer_2`
            (`PromptTokenizer(..., 77)`).
        - `t5_ids`: its ids from `tokenizer_3` (`max_sequence_length` of them).

        **Returns:**

        `{"context": [77 + T, t5 width], "pooled": [projection widths summed]}`.
        """
        first, second = self.clip_l(clip_l_ids), self.clip_g(clip_g_ids)
        assert first.text_embeds is not None and second.text_embeds is not None
        clip = jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1)
        t5 = self.t5(t5_ids)
        padded = jnp.pad(clip, ((0, 0), (0, t5.shape[-1] - clip.shape[-1])))
        context = jnp.concatenate([padded.astype(t5.dtype), t5], axis=0)
        pooled = jnp.concatenate([first.text_embeds, second.text_embeds])
        return {"context": context, "pooled": pooled}


@final
class FluxPromptEncoder(eqx.Module):
    """FLUX.1's two text encoders as `FluxPipeline.encode_prompt` joins them: T5's states are
    the `context`, CLIP-L's pooled end-of-text state (no projection) the `pooled`. The result
    is the `FluxCondition` a `Flux` takes (add `"guidance"` for FLUX.1-dev). vmap it over a
    batch of prompts.

    **Arguments:**

    - `clip`: the pipeline's `text_encoder` (a `CLIPTextModel`).
    - `t5`: its `text_encoder_2`.
    """

    clip: CLIPTextModel
    t5: T5Encoder

    def __call__(self, clip_ids: Int[Array, " 77"], t5_ids: Int[Array, " T"]) -> FluxCondition:
        """The condition of one prompt.

        **Arguments:**

        - `clip_ids`: the prompt's ids from `tokenizer` (77).
        - `t5_ids`: its ids from `tokenizer_2` (`max_sequence_length` of them).

        **Returns:**

        `{"context": [T, t5 width], "pooled": [clip width]}`.
        """
        return {"context": self.t5(t5_ids), "pooled": self.clip(clip_ids).pooled}


@final
class WanPromptEncoder(eqx.Module):
    """Wan 2.1's text encoder (umT5-XXL) as `WanPipeline.encode_prompt` uses it: the
    encoder's states with the padding's attention masked, then the rows past the prompt's
    tokens set to zero. The result is the `cond` a `Wan` takes. vmap it over a batch of
    prompts (the pipeline cleans each prompt's text first: `ftfy` and collapsed whitespace).

    **Arguments:**

    - `t5`: the pipeline's `text_encoder` (`load_t5` of a `UMT5EncoderModel` folder).
    """

    t5: T5Encoder

    def __call__(
        self, ids: Int[Array, " T"], attention_mask: Int[Array, " T"]
    ) -> Float[Array, "T D"]:
        """The condition of one prompt.

        **Arguments:**

        - `ids`: the prompt's ids from the pipeline's `tokenizer` (`max_sequence_length` of
            them, 512 in Wan 2.1's pipeline).
        - `attention_mask`: 1 for the prompt's tokens (its end token included), 0 for
            padding.

        **Returns:**

        `[T, width]`.
        """
        states = self.t5(ids, attention_mask)
        out: Float[Array, "T D"] = jnp.where(attention_mask[:, None] > 0, states, 0.0)
        return out
