"""A pipeline's text side: its prompt encoders and tokenizers run over prompts
`ENCODE_BATCH` at a time (`TextSide`), the encoders compiled over a batch (`jit_encoder`),
their outputs as NumPy rows (`numpy_rows`), and stand-in embeddings for random weights
(`random_rows`)."""

import dataclasses
import gc
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


Rows = dict[str, np.ndarray]
"""Per-prompt arrays by field: `{"context": [P, T, D], ...}`."""

ENCODE_BATCH = 8
"""Prompts embedded per call of the text encoders (the last call is padded to it, so the
encoders compile once)."""


@dataclasses.dataclass
class TextSide:
    """The text encoders and their tokenizers: prompts to the transformer's condition.

    `embed` runs them; `close` drops them (T5-XXL alone is 9.5 GB in bfloat16), after which
    `embed` refuses."""

    encode: Callable[[list[str]], Rows] | None

    def embed(self, prompts: list[str], progress: Callable[[int], None] | None = None) -> Rows:
        """The condition of every prompt, `ENCODE_BATCH` at a time.

        **Arguments:**

        - `prompts`: the prompts (at least one).
        - `progress`: called with the number of prompts embedded after each call.

        **Returns:**

        `{field: [len(prompts), ...]}` NumPy arrays.
        """
        if self.encode is None:
            raise RuntimeError("The text encoders were closed: embed every prompt before.")
        pieces: list[Rows] = []
        for start in range(0, len(prompts), ENCODE_BATCH):
            chunk = prompts[start : start + ENCODE_BATCH]
            padded = chunk + [chunk[-1]] * (ENCODE_BATCH - len(chunk))
            rows = self.encode(padded)
            pieces.append({name: value[: len(chunk)] for name, value in rows.items()})
            if progress is not None:
                progress(len(chunk))
        return {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}

    def close(self) -> None:
        """Drop the encoders and free their memory."""
        self.encode = None
        gc.collect()


def jit_encoder(encoder: Any, call: Callable[[Any, list[np.ndarray]], Any]) -> Any:
    """`encoder` compiled over a batch: `call(encoder, ids...)` vmapped."""
    batched = eqx.filter_jit(lambda enc, *ids: jax.vmap(lambda *one: call(enc, list(one)))(*ids))
    return lambda *ids: batched(encoder, *ids)


def numpy_rows(rows: Any, dtype: Any) -> Rows:
    """An encoder's output (a dict of fields, or the context alone) as NumPy rows in `dtype`."""
    if not isinstance(rows, dict):
        rows = {"context": rows}
    return {name: np.asarray(jnp.asarray(value, dtype)) for name, value in rows.items()}


def random_rows(shapes: Mapping[str, tuple[int, ...]], prompts: list[str], dtype: Any) -> Rows:
    """Stand-in embeddings of `shapes` for random weights: each prompt's drawn from a key
    of its text, so a prompt always gets the same one."""
    rows: dict[str, list[np.ndarray]] = {name: [] for name in shapes}
    for prompt in prompts:
        seed = int.from_bytes(prompt.encode("utf-8", "surrogatepass")[-8:].rjust(8, b"\0"), "big")
        rng = np.random.default_rng([len(prompt), seed])
        for name, shape in shapes.items():
            rows[name].append(rng.standard_normal(shape, np.float32).astype(dtype))
    return {name: np.stack(values) for name, values in rows.items()}
