"""The prompts' embeddings of a fine-tuning run: every prompt's condition and device-term
embedding, from the run folder's store or computed once and stored (`embed_prompts`)."""

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tqdm

from ._config import FinetuneConfig
from ._pipeline import Pipeline
from ._prompts import EmbeddingStore, PromptSet
from ._rewards import DeviceTerm


Rows = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Embedded:
    """Every prompt's rows: the condition and each device term's prompt embedding."""

    train: Rows
    heldout: Rows | None
    null: Rows | None


def text_key(config: FinetuneConfig) -> str:
    """What the prompts' condition depends on besides the prompts."""
    pipeline = config.pipeline
    identity: dict[str, Any] = {
        "kind": config.kind,
        "random": pipeline.random_weights,
        "dtype": pipeline.dtype,
        "text_length": config.prompts.text_length,
    }
    if pipeline.path is not None:
        folder = pathlib.Path(pipeline.path)
        identity["index"] = (folder / "model_index.json").read_text(errors="replace")
        identity["folder"] = str(folder.resolve())
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def embed_prompts(
    out: pathlib.Path,
    config: FinetuneConfig,
    pipeline: Pipeline,
    train: PromptSet,
    heldout: PromptSet | None,
    terms: list[DeviceTerm],
    quiet: bool,
    log: Callable[[str], None],
) -> Embedded:
    """Every train and held-out prompt's condition and device-term embedding (and the
    negative prompt's condition), from the run folder's store or computed once and stored;
    then the text encoders are freed."""
    store = EmbeddingStore(out / "embeddings")
    key = text_key(config)

    def rows_of(name: str, prompts: PromptSet) -> Rows:
        bar = tqdm.tqdm(
            total=len(prompts), desc=f"embedding {name} prompts", disable=quiet, leave=False
        )
        with bar:
            rows, reused = store.get(
                name,
                f"{key}.{prompts.fingerprint()}",
                lambda: pipeline.text.embed(list(prompts.prompts), bar.update),
            )
        for term in terms:
            term_key = f"{term.name}.{prompts.fingerprint()}.{reward_term_key(config, term.name)}"
            stored, _ = store.get(f"{name}.{term.name}", term_key, embedding_of(term, prompts))
            rows[term.row_key] = stored["embedding"]
        if reused:
            log(f"Reused the {name} prompts' embeddings of {store.folder}.")
        return rows

    train_rows = rows_of("train", train)
    heldout_rows = rows_of("heldout", heldout) if heldout is not None else None
    null = None
    if pipeline.needs_null:
        negative = PromptSet((config.prompts.negative,), ({},), "prompts.negative")
        null, _ = store.get(
            "null",
            f"{key}.{negative.fingerprint()}",
            lambda: pipeline.text.embed([config.prompts.negative]),
        )
    pipeline.text.close()
    return Embedded(train_rows, heldout_rows, null)


def embedding_of(term: DeviceTerm, prompts: PromptSet) -> Callable[[], Rows]:
    """What `EmbeddingStore.get` makes a device term's prompt embeddings with."""
    return lambda: {"embedding": term.embed(prompts.prompts)}


def reward_term_key(config: FinetuneConfig, name: str) -> str:
    """What a device term's prompt embeddings depend on besides the prompts.

    **Arguments:**

    - `config`: the run's configuration.
    - `name`: the reward term's name.

    **Returns:**

    A short hash of the term's kind, model and processor.
    """
    term = config.rewards[name]
    return hashlib.sha256(f"{term.kind}|{term.model}|{term.processor}".encode()).hexdigest()[:12]
