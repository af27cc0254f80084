"""`flowgrpo-eqx finetune`'s configuration: one TOML file of sections, checked as a whole.

Every setting has a default but `pipeline.path` (or `pipeline.random_weights`) and
`prompts.train`; where the default depends on the pipeline's model kind (guidance, grids, the
text encoder's length, the LoRA targets), it is `none` in the file and resolved once the kind
is known (`FinetuneConfig.resolved`). `--set section.key=value` overrides a value,
`--print-config` prints the resolved configuration with every default.

A key the configuration does not know is refused, naming it and the nearest known key; a
table of another algorithm than the chosen one, or a reward key its kind does not read, is
refused naming what reads it (a setting that does nothing is never accepted silently).

The sections themselves (one dataclass each, `SECTIONS`) and `ConfigError` live in
`_sections`; they are importable from here too.
"""

import dataclasses
import difflib
import json
import os
import pathlib
import tomllib
import typing
from collections.abc import Mapping
from typing import Any

from ..settings import MAX_SEED, check_setting, split_optional
from ._algorithms import ALGORITHM_TABLES, AlgorithmSettings, algorithm_settings
from ._kinds import MODEL_KINDS, ModelKind
from ._sections import (
    REWARD_KEYS as REWARD_KEYS,
    REWARD_OPTIONAL as REWARD_OPTIONAL,
    SECTIONS as SECTIONS,
    AlgorithmChoice as AlgorithmChoice,
    AttentionKind as AttentionKind,
    CheckpointSettings as CheckpointSettings,
    ConfigError as ConfigError,
    Dtype as Dtype,
    EvaluationSettings as EvaluationSettings,
    LoggingSettings as LoggingSettings,
    LoraInit as LoraInit,
    LoraSettings as LoraSettings,
    MeshSettings as MeshSettings,
    PipelineSettings as PipelineSettings,
    PrecisionSettings as PrecisionSettings,
    PromptSettings as PromptSettings,
    Remat as Remat,
    RewardKind as RewardKind,
    RewardTerm as RewardTerm,
    SamplingSettings as SamplingSettings,
    Schedule as Schedule,
    TrainingSettings as TrainingSettings,
    WriterName as WriterName,
)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Every setting of a fine-tuning run; `read_config` makes one from a file.

    **Raises:**

    - `ConfigError`: naming the settings that do not fit together.
    """

    pipeline: PipelineSettings
    prompts: PromptSettings
    rewards: dict[str, RewardTerm]
    algorithm: AlgorithmChoice
    algorithm_table: AlgorithmSettings
    lora: LoraSettings
    sampling: SamplingSettings
    training: TrainingSettings
    mesh: MeshSettings
    precision: PrecisionSettings
    checkpoint: CheckpointSettings
    evaluation: EvaluationSettings
    logging: LoggingSettings
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ConfigError(
                "The configuration has no reward: add a table [reward.<name>] with a `kind` "
                "(pickscore, clipscore, http or python), e.g. [reward.pickscore] kind = "
                '"pickscore", model = "PickScore_v1".'
            )
        compressed = getattr(self.algorithm_table, "compress_ratio", None)
        if compressed is not None and self.sampling.time_shift is None:
            raise ConfigError(
                f"Setting `sampling.time_shift` must be given with `algorithm."
                f"{self.algorithm.name}.compress_ratio`: MixGRPO-Flash rebuilds the grid after "
                "its window as the release does, on the uniform grid shifted by `--shift` (3 in "
                "its scripts), not on a scheduler's grid."
            )
        rows = self.sampling.prompts_per_epoch * self.sampling.group_size
        if rows % self.training.updates_per_epoch:
            raise ConfigError(
                f"Setting `training.updates_per_epoch`={self.training.updates_per_epoch} must "
                f"divide an epoch's {rows} samples (sampling.prompts_per_epoch x "
                "sampling.group_size)."
            )

    @property
    def kind(self) -> ModelKind:
        """The model kind: from `random_weights`, else the pipeline folder's
        `model_index.json` (`_kinds.pipeline_kind`)."""
        from ._kinds import kind_of_published_size, pipeline_kind

        if self.pipeline.random_weights is not None:
            return kind_of_published_size(self.pipeline.random_weights)
        assert self.pipeline.path is not None
        return pipeline_kind(pathlib.Path(self.pipeline.path))

    def resolved(self) -> "FinetuneConfig":
        """The configuration with every `none` that means "the model kind's default" filled
        in from `kind` (`_kinds.MODEL_KINDS`).

        **Raises:**

        - `PipelineError`: as `kind`.
        """
        defaults = MODEL_KINDS[self.kind]
        sampling = dataclasses.replace(
            self.sampling,
            resolution=(
                self.sampling.resolution
                if self.sampling.resolution is not None or self.sampling.height is not None
                else defaults.resolution
            ),
            frames=self.sampling.frames if self.sampling.frames is not None else defaults.frames,
            train_steps=self.sampling.train_steps or defaults.train_steps,
            eval_steps=self.sampling.eval_steps or defaults.eval_steps,
            guidance_scale=(
                self.sampling.guidance_scale
                if self.sampling.guidance_scale is not None
                else defaults.guidance_scale
            ),
        )
        prompts = dataclasses.replace(
            self.prompts, text_length=self.prompts.text_length or defaults.text_length
        )
        lora = dataclasses.replace(self.lora, targets=self.lora.targets or defaults.lora_targets)
        return dataclasses.replace(self, sampling=sampling, prompts=prompts, lora=lora)

    def image_size(self) -> tuple[int, int]:
        """`(height, width)` in pixels of a resolved configuration."""
        if self.sampling.height is not None and self.sampling.width is not None:
            return self.sampling.height, self.sampling.width
        assert self.sampling.resolution is not None
        return self.sampling.resolution, self.sampling.resolution

    def identity(self) -> dict[str, Any]:
        """The settings that determine what a run computes, as JSON values: every one but
        where files live and how often the run is logged, evaluated and saved
        (`FREE_ON_RESUME`)."""
        table = to_table(self)
        for dotted in FREE_ON_RESUME:
            section_name, _, key = dotted.partition(".")
            table.get(section_name, {}).pop(key, None)
        for term in table.get("reward", {}).values():
            for key in ("url", "timeout", "retries"):
                term.pop(key, None)
        loaded: dict[str, Any] = json.loads(json.dumps(table))
        return loaded


FREE_ON_RESUME: tuple[str, ...] = (
    "pipeline.path",
    "prompts.train",
    "prompts.heldout",
    "prompts.heldout_limit",
    "prompts.preview",
    "training.epochs",
    "checkpoint.every",
    "checkpoint.keep",
    "evaluation.every",
    "evaluation.before",
    "logging.writers",
    "mesh.devices",
    "mesh.fsdp",
    "mesh.fsdp_min_elements",
)
"""What a resumed run may change: where the pipeline and prompts files are (their content is
checked by the prompts' fingerprint), more epochs, the cadences, logging, and how the weights
lie on the devices. A reward's URL, timeout and retries too."""


def _nearest(key: str, known: list[str], where: str = "") -> str:
    """ " Did you mean `where.nearest`?", or the known keys when none is near."""
    prefix = f"{where}." if where else ""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if close:
        return f" Did you mean `{prefix}{close[0]}`?"
    return f" Known: {', '.join(sorted(known))}."


def _field_names(cls: type[Any]) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def _make_section(cls: type[Any], where: str, table: Mapping[str, Any], source: str) -> Any:
    """The section `cls` from `table`, every key checked and converted from TOML."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: `{where}` must be a table, got {table!r}.")
    known = _field_names(cls)
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(
                f"{source}: unknown setting `{where}.{key}`.{_nearest(key, known, where)}"
            )
        values[key] = _from_toml(hints[key], value)
    bounds = {field.name: field.metadata["bounds"] for field in dataclasses.fields(cls)}

    def make() -> Any:
        for key, value in values.items():
            check_setting(key, hints[key], value, bounds[key])
        return cls(**values)

    return _checked(make, where, source)


def _checked(make: Any, where: str, source: str) -> Any:
    try:
        return make()
    except ValueError as error:
        text = str(error).replace("Setting `", f"Setting `{where}.", 1)
        raise ConfigError(f"{source}: {text}") from None


def _from_toml(annotation: Any, value: Any) -> Any:
    """A TOML value as the setting's type: arrays become tuples, "none" becomes `None`."""
    optional, base = split_optional(annotation)
    if optional and (value == "none" or value is None):
        return None
    if typing.get_origin(base) is tuple and isinstance(value, list):
        return tuple(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_from_table(
    table: Mapping[str, Any], source: str = "the configuration"
) -> FinetuneConfig:
    """The configuration a parsed TOML table states.

    **Arguments:**

    - `table`: the file's table (after `--set` overrides).
    - `source`: the file, for messages.

    **Returns:**

    The `FinetuneConfig` (not yet `resolved`).

    **Raises:**

    - `ConfigError`: naming the key, for an unknown key (with the nearest known one), a
        bad value, a table of an algorithm other than the chosen one, a reward key its kind
        does not read, or settings that do not fit together.
    """
    seed = _checked_top_level(table, source)
    algorithm_table = dict(table.get("algorithm", {}))
    per_algorithm = {
        name: algorithm_table.pop(name)
        for name in list(algorithm_table)
        if name in ALGORITHM_TABLES
    }
    sections = {
        name: _make_section(
            cls, name, algorithm_table if name == "algorithm" else table.get(name, {}), source
        )
        for name, cls in SECTIONS.items()
        if name != "pipeline" or "pipeline" in table
    }
    if "pipeline" not in sections:
        raise ConfigError(
            f"{source}: no [pipeline] section: set `pipeline.path` to a diffusers pipeline folder."
        )
    algorithm = _algorithm_settings(sections["algorithm"].name, per_algorithm, source)
    rewards = {
        name: _reward_term(name, term, source)
        for name, term in dict(table.get("reward", {})).items()
    }
    try:
        return FinetuneConfig(
            **sections,
            rewards=rewards,
            algorithm_table=algorithm,
            seed=seed,
        )
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _checked_top_level(table: Mapping[str, Any], source: str) -> int:
    """Refuse a top-level key that is neither a section, `reward` nor `seed`; the seed."""
    known = [*SECTIONS, "reward", "seed"]
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{source}: unknown section or setting `{key}`.{_nearest(key, known)}"
            )
    seed = table.get("seed", 0)
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"{source}: Setting `seed` must be an int in 0..{MAX_SEED}, got {seed!r}."
        )
    return seed


def _algorithm_settings(
    chosen: str, per_algorithm: dict[str, Any], source: str
) -> AlgorithmSettings:
    """The chosen algorithm's own table (`[algorithm.<name>]`), checked: refuse another
    algorithm's table, and a key the chosen one does not read (naming what reads it)."""
    for name in per_algorithm:
        if name != chosen:
            raise ConfigError(
                f"{source}: the table [algorithm.{name}] is read only by algorithm {name!r}; "
                f"the chosen algorithm is {chosen!r} (`algorithm.name`). Remove the table, or "
                f"choose {name!r}."
            )
    own = per_algorithm.get(chosen, {})
    if not isinstance(own, Mapping):
        raise ConfigError(f"{source}: `algorithm.{chosen}` must be a table, got {own!r}.")
    settings_cls = ALGORITHM_TABLES[chosen]
    known_keys = _field_names(settings_cls)
    hints = typing.get_type_hints(settings_cls)
    for key in own:
        if key not in known_keys:
            readers = [n for n, c in ALGORITHM_TABLES.items() if key in _field_names(c)]
            hint = (
                f" It is read by {', '.join(repr(r) for r in readers)}."
                if readers
                else _nearest(key, known_keys, f"algorithm.{chosen}")
            )
            raise ConfigError(
                f"{source}: algorithm {chosen!r} has no setting `algorithm.{chosen}.{key}`.{hint}"
            )
    own_values = {k: _from_toml(hints[k], v) for k, v in own.items()}
    own_fields = dataclasses.fields(settings_cls)  # type: ignore[arg-type]
    own_bounds = {field.name: field.metadata["bounds"] for field in own_fields}

    def make_algorithm() -> AlgorithmSettings:
        for key, value in own_values.items():
            check_setting(key, hints[key], value, own_bounds[key])
        return algorithm_settings(chosen, own_values)

    settings: AlgorithmSettings = _checked(make_algorithm, f"algorithm.{chosen}", source)
    return settings


def _reward_term(name: str, table: Any, source: str) -> RewardTerm:
    where = f"reward.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: `{where}` must be a table with a `kind`, got {table!r}.")
    kind = table.get("kind", "pickscore")
    if kind in REWARD_KEYS:
        reads = {"kind", "weight", *REWARD_KEYS[kind], *REWARD_OPTIONAL[kind]}
        for key in table:
            if key in _field_names(RewardTerm) and key not in reads:
                readers = [k for k in REWARD_KEYS if key in (*REWARD_KEYS[k], *REWARD_OPTIONAL[k])]
                raise ConfigError(
                    f"{source}: a reward of kind {kind!r} does not read `{where}.{key}` (read by "
                    f"kind {', '.join(repr(r) for r in readers)}). Remove it."
                )
    term: RewardTerm = _make_section(RewardTerm, where, table, source)
    return term


def read_config(
    path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()
) -> FinetuneConfig:
    """Read a configuration file, apply `--set` overrides, and check it.

    **Arguments:**

    - `path`: the TOML file.
    - `overrides`: `section.key=value` strings; the value is read as TOML (a bare word is a
        string).

    **Returns:**

    The `FinetuneConfig` (not yet `resolved`).

    **Raises:**

    - `ConfigError`: naming the file for one that cannot be read or is not TOML (with the
        line), an override that is not `section.key=value`, and as `config_from_table`.
    """
    file = pathlib.Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Cannot read the configuration file {file}: {error}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{file} is not valid TOML: {error}") from None
    for override in overrides:
        apply_override(table, override)
    config = config_from_table(table, str(file))
    return config


def apply_override(table: dict[str, Any], override: str) -> None:
    """Set `section.key=value` (or `seed=value`, `reward.name.key=value`,
    `algorithm.name.key=value`) in a parsed table.

    **Raises:**

    - `ConfigError`: naming the override when it has no `=` or no key.
    """
    dotted, equals, text = override.partition("=")
    dotted = dotted.strip()
    if not equals or not dotted:
        raise ConfigError(
            f"--set {override!r} must be section.key=value, e.g. training.learning_rate=1e-4."
        )
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    parts = dotted.split(".")
    target = table
    for part in parts[:-1]:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: `{part}` is a value, not a table.")
        target = child
    target[parts[-1]] = value


def to_table(config: FinetuneConfig) -> dict[str, Any]:
    """The configuration as a TOML table, every setting included (`none` for `None`)."""

    def values(section_value: Any) -> dict[str, Any]:
        out = {}
        for field in dataclasses.fields(section_value):
            value = getattr(section_value, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    table: dict[str, Any] = {"seed": config.seed}
    for name in SECTIONS:
        table[name] = values(getattr(config, name))
    table["algorithm"][config.algorithm.name] = values(config.algorithm_table)
    table["reward"] = {name: values(term) for name, term in config.rewards.items()}
    return table


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def config_to_toml(config: FinetuneConfig) -> str:
    """The configuration as a TOML file that `read_config` reads back to an equal
    configuration, every setting written with its help text."""
    table = to_table(config)
    lines = [f"seed = {config.seed}"]
    helps = {name: _helps(cls) for name, cls in SECTIONS.items()}
    for name, cls in SECTIONS.items():
        lines += ["", f"[{name}]"]
        for key, value in table[name].items():
            if isinstance(value, dict):
                continue
            lines.append(f"{key} = {_toml_value(value)}  # {helps[name][key]}")
        if name == "algorithm":
            own = table["algorithm"][config.algorithm.name]
            own_help = _helps(type(config.algorithm_table))
            lines += ["", f"[algorithm.{config.algorithm.name}]"]
            lines += [f"{k} = {_toml_value(v)}  # {own_help[k]}" for k, v in own.items()]
        del cls
    term_help = _helps(RewardTerm)
    for reward, term in table["reward"].items():
        kind = term["kind"]
        reads = ("kind", "weight", *REWARD_KEYS[kind], *REWARD_OPTIONAL[kind])
        lines += ["", f"[reward.{json.dumps(reward) if '.' in reward else reward}]"]
        lines += [f"{k} = {_toml_value(term[k])}  # {term_help[k]}" for k in reads]
    return "\n".join(lines) + "\n"


def _helps(cls: type[Any]) -> dict[str, str]:
    return {field.name: field.metadata["help"] for field in dataclasses.fields(cls)}
