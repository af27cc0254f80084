"""The configured reward: a weighted sum of terms, each on the device (PickScore, CLIPScore:
compiled into the rollout's program) or on the host (a reward server, a Python function).

flow_grpo's `reward_fn = {"pickscore": 1.0, ...}`: the training reward of a sample is the sum
of each term's score times its weight, and the advantages are computed from that sum.
"""

import dataclasses
import http.client
import json
import pathlib
import urllib.parse
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .. import FlowReward, HttpReward, load_reward
from ..models import CLIPModel, PromptTokenizer, TowerShape, load_clip
from ..rewards import AbstractCLIPReward, CLIPScore, PickScore, score
from ._config import RewardTerm
from ._prompts import PromptSet


class RewardSetupError(ValueError):
    """A reward that cannot be set up: the message names the term and what is wrong."""


class DeviceTerm(eqx.Module):
    """A term scored on the device: `score(sample, rows[row_key])` per sample (the mean over
    a video's frames), times `weight`. A module: its score's weights are traced into the
    programs that use it."""

    name: str = eqx.field(static=True)
    weight: float = eqx.field(static=True)
    score: AbstractCLIPReward
    tokenizer: PromptTokenizer | None = eqx.field(static=True)

    @property
    def row_key(self) -> str:
        """The rows' field holding each prompt's embedding for this term."""
        return f"reward.{self.name}"

    def embed(self, prompts: Sequence[str]) -> np.ndarray:
        """Each prompt's embedding for the score (`prompt_embedding`), `[P, projection]`."""
        if self.tokenizer is None:
            ids = np.stack([_stand_in_ids(prompt) for prompt in prompts])
            mask = np.ones_like(ids)
        else:
            ids, mask = self.tokenizer.encode(list(prompts))
        embedded = _embed_prompts(self.score, jnp.asarray(ids), jnp.asarray(mask))
        return np.asarray(embedded, np.float32)


@eqx.filter_jit
def _embed_prompts(score: AbstractCLIPReward, ids: Array, mask: Array) -> Array:
    return jax.vmap(score.prompt_embedding)(ids, mask)


@dataclasses.dataclass(frozen=True)
class HostTerm:
    """A term scored on the host: a `FlowReward` called with the samples and the rows (the
    prompts and their metadata under `"prompt"` and `"metadata"`), times `weight`."""

    name: str
    weight: float
    reward: FlowReward


def _stand_in_ids(prompt: str) -> np.ndarray:
    """Token ids for a random-weights reward, which has no tokenizer: the start token, a few
    ids drawn from the prompt's text, the end token, padding."""
    rng = np.random.default_rng(list(prompt.encode("utf-8", "surrogatepass")) or [0])
    words = rng.integers(1, 49406, size=min(75, max(1, len(prompt.split()))))
    ids = np.full(77, 49407, np.int32)
    ids[0] = 49406
    ids[1 : 1 + len(words)] = words
    return ids


def score_terms(
    terms: Sequence[DeviceTerm], samples: Float[Array, "N ..."], rows: dict[str, Any]
) -> dict[str, Float[Array, " N"]]:
    """Each device term's scores (unweighted), traced into the caller's program.

    **Arguments:**

    - `terms`: the device terms.
    - `samples`: decoded samples, `[N, H, W, C]` images or `[N, F, H, W, C]` videos, in
        `[-1, 1]`.
    - `rows`: the rows of the samples, holding each term's `row_key`.

    **Returns:**

    `{name: [N] float32}`.
    """
    scores = {}
    for term in terms:
        prompts = rows[term.row_key]
        if samples.ndim == 5:
            per_frame = jax.vmap(jax.vmap(term.score, in_axes=(0, None)), in_axes=(0, 0))
            scores[term.name] = jnp.mean(per_frame(samples, prompts), axis=1)
        else:
            scores[term.name] = jax.vmap(term.score)(samples, prompts)
    return scores


_PICKSCORE_TEXT = TowerShape(1024, 16, 4096, 24, "gelu", 1e-5)
_PICKSCORE_VISION = TowerShape(1280, 16, 5120, 32, "gelu", 1e-5)
"""PickScore's CLIP-ViT-H-14 (`yuvalkirstain/PickScore_v1`'s config): 1.0 billion
parameters."""

_CLIP_L_TEXT = TowerShape(768, 12, 3072, 12, "quick_gelu", 1e-5)
_CLIP_L_VISION = TowerShape(1024, 16, 4096, 24, "quick_gelu", 1e-5)
"""OpenAI's CLIP ViT-L/14, torchmetrics' default CLIP score model."""


def _random_clip(kind: str, dtype: Any) -> CLIPModel:
    """PickScore's CLIP-ViT-H-14 (or CLIP score's ViT-L/14) with random weights in `dtype`."""
    from ._pipeline import random_model

    text, vision, width = (
        (_PICKSCORE_TEXT, _PICKSCORE_VISION, 1024)
        if kind == "pickscore"
        else (_CLIP_L_TEXT, _CLIP_L_VISION, 768)
    )
    made: CLIPModel = random_model(lambda key: CLIPModel(text, vision, width, key=key), dtype)
    return made


def _device_term(name: str, term: RewardTerm, dtype: Any) -> DeviceTerm:
    assert term.model is not None
    if term.model == "random":
        model = _random_clip(term.kind, dtype)
        tokenizer = None
    else:
        folder = pathlib.Path(term.model)
        try:
            loaded = load_clip(folder, dtype=dtype)
        except (OSError, ValueError) as error:
            raise RewardSetupError(
                f"Setting `reward.{name}.model` ({folder}) cannot be read as a CLIP model: {error}"
            ) from None
        if not isinstance(loaded, CLIPModel):
            raise RewardSetupError(
                f"Setting `reward.{name}.model` ({folder}) holds a {type(loaded).__name__}, not "
                f"the CLIPModel a {term.kind} reward compares images and prompts with (a "
                'PickScore or CLIP folder, config `architectures` ["CLIPModel"]).'
            )
        model = loaded
        processor = pathlib.Path(term.processor) if term.processor is not None else folder
        try:
            tokenizer = PromptTokenizer(processor, 77)
        except (OSError, ValueError) as error:
            raise RewardSetupError(
                f"Setting `reward.{name}.processor` ({processor}) has no usable CLIP tokenizer: "
                f"{error}"
            ) from None
    score: AbstractCLIPReward = PickScore(model) if term.kind == "pickscore" else CLIPScore(model)
    return DeviceTerm(name, term.weight, score, tokenizer)


def check_server(url: str, timeout: float = 10.0) -> None:
    """Ask a reward server's `/health` before any work, so that one that is down is named at
    the start rather than after the first rollout.

    **Raises:**

    - `RewardSetupError`: naming the URL and what happened.
    """
    parsed = urllib.parse.urlsplit(url)
    connection_type = (
        http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    )
    path = parsed.path.rstrip("/")
    path = path.removesuffix("/score") + "/health"
    try:
        connection = connection_type(parsed.hostname or "", parsed.port, timeout=timeout)
        try:
            connection.request("GET", path)
            reply = connection.getresponse()
            body = reply.read(4096)
        finally:
            connection.close()
    except (OSError, http.client.HTTPException) as error:
        raise RewardSetupError(
            f"The reward server at {url} does not answer ({type(error).__name__}: {error}). "
            "Start it first (`flowgrpo-eqx serve-reward ...`), or check the URL."
        ) from None
    if reply.status != 200:
        raise RewardSetupError(
            f"The reward server at {url} answered /health with HTTP {reply.status}: {body[:200]!r}."
        )


def build_terms(
    rewards: dict[str, RewardTerm], dtype: Any, token: str | None = None
) -> tuple[list[DeviceTerm], list[HostTerm]]:
    """The configured terms, device terms first.

    **Arguments:**

    - `rewards`: the `[reward.<name>]` tables.
    - `dtype`: the device rewards' weights' dtype.
    - `token`: the reward servers' token, if any.

    **Returns:**

    `(device_terms, host_terms)`.

    **Raises:**

    - `RewardSetupError`: naming the term, for a model folder that is not a CLIP model, a
        processor without a tokenizer, a server that does not answer, a Python reward that
        cannot be loaded.
    """
    device: list[DeviceTerm] = []
    host: list[HostTerm] = []
    for name, term in rewards.items():
        if term.kind in ("pickscore", "clipscore"):
            device.append(_device_term(name, term, dtype))
        elif term.kind == "http":
            assert term.url is not None
            try:
                client = HttpReward(
                    term.url, timeout=term.timeout, retries=term.retries, token=token
                )
            except ValueError as error:
                raise RewardSetupError(f"Setting `reward.{name}.url`: {error}") from None
            check_server(term.url)
            host.append(HostTerm(name, term.weight, client))
        else:
            assert term.function is not None
            try:
                host.append(HostTerm(name, term.weight, load_reward(term.function)))
            except ValueError as error:
                raise RewardSetupError(f"Setting `reward.{name}.function`: {error}") from None
    return device, host


def host_scores(
    terms: Sequence[HostTerm], samples: np.ndarray, prompts: PromptSet, indices: np.ndarray
) -> dict[str, np.ndarray]:
    """Each host term's scores (unweighted), checked.

    **Arguments:**

    - `terms`: the host terms.
    - `samples`: `[N, ...]` decoded samples on the host.
    - `prompts`: the prompt set the rows come from.
    - `indices`: `[N]` each sample's prompt index.

    **Returns:**

    `{name: [N] float64}`.

    **Raises:**

    - `RewardError`: naming the reward, if it raises, returns the wrong shape, NaN or inf.
    """
    rows = {
        "prompt": np.asarray([prompts.prompts[i] for i in indices], dtype=np.str_),
        "metadata": np.asarray(
            [json.dumps(prompts.metadata[i], ensure_ascii=False) for i in indices],
            dtype=np.str_,
        ),
    }
    return {term.name: score(term.reward, samples, rows) for term in terms}


class CombinedReward:
    """The configured weighted sum as one host `FlowReward`: what `FlowRollout.collect`
    scores with. The fine-tuning loop scores the device terms inside its rollout program
    instead; this computes the same total from decoded samples on the host (the device terms
    compiled once), for callers that collect the library's way.

    **Arguments:**

    - `device_terms`, `host_terms`: the terms (`build_terms`).

    Rows carry each device term's `row_key` and, for host terms, `"prompt"` and
    `"metadata"`.
    """

    name = "finetune_reward"

    def __init__(self, device_terms: Sequence[DeviceTerm], host_terms: Sequence[HostTerm]):
        self.device_terms = list(device_terms)
        self.host_terms = list(host_terms)
        self._device = eqx.filter_jit(score_terms)

    def __call__(self, samples: np.ndarray, rows: Any) -> np.ndarray:
        """The weighted total of every term for `samples`, `[N]` float64."""
        total = np.zeros(len(samples), np.float64)
        if self.device_terms:
            device_rows = {
                term.row_key: jnp.asarray(rows[term.row_key]) for term in self.device_terms
            }
            scores = self._device(self.device_terms, jnp.asarray(samples), device_rows)
            for device_term in self.device_terms:
                total += device_term.weight * np.asarray(scores[device_term.name], np.float64)
        for host_term in self.host_terms:
            total += host_term.weight * score(host_term.reward, samples, rows)
        return total
