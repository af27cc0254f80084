"""Small configurations of `flowgrpo-eqx finetune` over the tiny pipelines of
`tests/data/pipelines` (made by diffusers in the published layouts), shared by the finetune
tests."""

import pathlib
from typing import Any


PIPELINES = pathlib.Path(__file__).resolve().parent / "data" / "pipelines"
PICKSCORE = PIPELINES / "rewards" / "pickscore"
PROCESSOR = PIPELINES / "rewards" / "processor"

TRAIN_PROMPTS = (
    "a photo of a cat",
    "a red cube on the left of a blue sphere",
    "two green apples",
    "a lighthouse at dusk",
)
HELDOUT = (
    '{"prompt": "a blue cube", "tag": "color"}',
    '{"prompt": "a small dog on a sofa"}',
)

SIZES: dict[str, dict[str, Any]] = {
    "sd35": {"resolution": 16},
    "flux_dev": {"resolution": 16},
    "flux_schnell": {"resolution": 16},
    "wan": {"resolution": 32, "frames": 5},
}
"""The sizes each tiny pipeline makes (its fixtures' sizes)."""


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return repr(value)


def write_prompts(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The train prompts (a text file) and the held-out ones (JSON lines) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train.txt"
    train.write_text("\n".join(TRAIN_PROMPTS) + "\n")
    heldout = folder / "heldout.jsonl"
    heldout.write_text("\n".join(HELDOUT) + "\n")
    return train, heldout


def tiny_table(
    folder: pathlib.Path,
    kind: str,
    *,
    rewards: dict[str, dict[str, Any]] | None = None,
    algorithm: str = "flow_grpo",
    algorithm_table: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> dict[str, Any]:
    """A configuration of the tiny `kind` pipeline as a table: two prompts of two samples an
    epoch, two sampling steps, rank-2 adapters, float32, a checkpoint and an evaluation every
    epoch; PickScore by default. `sections` update the sections' tables."""
    train, heldout = write_prompts(folder / "prompts")
    table: dict[str, Any] = {
        "seed": 0,
        "pipeline": {"path": str(PIPELINES / kind), "dtype": "float32"},
        "prompts": {
            "train": str(train),
            "heldout": str(heldout),
            "text_length": 16,
            "preview": 2,
        },
        "reward": rewards
        if rewards is not None
        else {
            "pickscore": {"kind": "pickscore", "model": str(PICKSCORE), "processor": str(PROCESSOR)}
        },
        "algorithm": {
            "name": algorithm,
            **({algorithm: algorithm_table} if algorithm_table else {}),
        },
        "lora": {"rank": 2, "alpha": 4.0},
        "sampling": {
            **SIZES[kind],
            "train_steps": 2,
            "eval_steps": 2,
            "group_size": 2,
            "prompts_per_epoch": 2,
            "batch": 4,
            "eval_batch": 2,
        },
        "training": {"epochs": 2, "batch": 2, "updates_per_epoch": 2, "ema_every": 1},
        "precision": {"compute": "float32"},
        "checkpoint": {"every": 1},
        "evaluation": {"every": 1},
        "logging": {"writers": ["tensorboard"]},
    }
    for name, values in sections.items():
        table.setdefault(name, {}).update(values)
    return table


def write_config(path: pathlib.Path, table: dict[str, Any]) -> pathlib.Path:
    """Write a configuration table as TOML."""
    lines = []
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    lines += [f"{k} = {_toml(v)}" for k, v in scalars.items()]

    def section(prefix: str, values: dict[str, Any]) -> None:
        plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
        lines.append(f"\n[{prefix}]")
        lines.extend(f"{k} = {_toml(v)}" for k, v in plain.items())
        for key, value in values.items():
            if isinstance(value, dict):
                section(f"{prefix}.{key}", value)

    for name, values in table.items():
        if isinstance(values, dict):
            section(name, values)
    path.write_text("\n".join(lines) + "\n")
    return path
