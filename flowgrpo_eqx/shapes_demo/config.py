"""The main job's settings: `JobConfig`, one section per concern (`settings`), checked as a
whole when it is made; presets; and the settings as a TOML file.

Every setting has one name, its flag (`flowgrpo-eqx train --help` lists them all) and its
TOML key; `SETTINGS` lists them in the order of the flags and of a run's `config.toml`.
"""

import dataclasses
import hashlib
import json
import os
import tomllib
import typing
import warnings
from collections.abc import Collection, Mapping
from typing import Any

from .algorithms import ALGORITHM_SETTINGS, ALGORITHMS, AbstractAlgorithm
from .settings import (
    EvaluationSettings,
    LoggingSettings,
    ModelSettings,
    ObjectiveSettings,
    PretrainingSettings,
    RewardSettings,
    RolloutSettings,
    TrainingSettings,
    split_optional,
)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """Every setting of the main job, one section per concern; `flowgrpo-eqx train --help`
    lists them as flags.

    Each section checks its own settings when it is made; `JobConfig` checks what crosses
    sections: the minibatch against the rollout, the settings the chosen algorithm refuses
    (`algorithms.AbstractAlgorithm.check`), and that no setting the chosen algorithm does
    not read (`algorithms.ALGORITHM_SETTINGS` outside its `reads`) is set to other than its
    default, where it would be written to `config.toml` and ignored. `make_config` and
    `from_settings` make one from settings by name.

    **Raises:**

    - `ValueError`: naming the setting, for settings that do not fit together (a
        `minibatch_rows` that does not divide a rollout's rows, `shared_noise` with `nft`,
        `clip_range` other than its default with `dppo`, which has no ratio clip, ...); a
        setting the algorithm does not read is named with the algorithms that read it.
    """

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    pretraining: PretrainingSettings = dataclasses.field(default_factory=PretrainingSettings)
    rollout: RolloutSettings = dataclasses.field(default_factory=RolloutSettings)
    rewards: RewardSettings = dataclasses.field(default_factory=RewardSettings)
    objective: ObjectiveSettings = dataclasses.field(default_factory=ObjectiveSettings)
    training: TrainingSettings = dataclasses.field(default_factory=TrainingSettings)
    evaluation: EvaluationSettings = dataclasses.field(default_factory=EvaluationSettings)
    logging: LoggingSettings = dataclasses.field(default_factory=LoggingSettings)

    def __post_init__(self) -> None:
        self.chosen_algorithm.check(self)
        unread = unread_settings(self)
        if unread:
            raise ValueError(_unread_message(self.objective.algorithm, unread, "at"))
        rows = self.rollout.rollout_rows
        minibatch_rows = self.training.minibatch_rows
        if minibatch_rows is not None and rows % minibatch_rows != 0:
            raise ValueError(
                f"Setting `minibatch_rows`={minibatch_rows} must divide a rollout's "
                f"{rows} rows (prompts_per_epoch x groups)."
            )

    @property
    def chosen_algorithm(self) -> AbstractAlgorithm:
        """The algorithm the `algorithm` setting names (`algorithms.ALGORITHMS`)."""
        return ALGORITHMS[self.objective.algorithm]

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "JobConfig":
        """The configuration with `settings` (by name, as the flags and TOML keys say) and
        every other setting at its default.

        **Raises:**

        - `ValueError`: for an unknown setting, or a bad value (naming the setting).
        """
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ValueError(f"Unknown settings {unknown}; known: {sorted(SETTINGS)}.")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in settings.items():
            grouped[SETTINGS[key].section][SETTINGS[key].field] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in grouped.items()})

    def settings(self) -> dict[str, Any]:
        """Every setting by name, in `SETTINGS`' order."""
        return {key: setting.value(self) for key, setting in SETTINGS.items()}

    def replace(self, **changes: Any) -> "JobConfig":
        """This configuration with `changes` (settings by name), checked as a whole.

        **Raises:**

        - `ValueError`: for an unknown setting, or a bad value (naming the setting).
        """
        return JobConfig.from_settings({**self.settings(), **changes})

    def base_fingerprint(self) -> str:
        """A hash of everything that determines the pretrained base model (and nothing else:
        the Flow-GRPO `seed` does not enter, so every training seed reuses one base)."""
        model, pretraining = self.model, self.pretraining
        settings: dict[str, Any] = {
            "width": model.width,
            "depth": model.depth,
            "heads": model.heads,
            "patch": model.patch,
            "pretrain_steps": pretraining.pretrain_steps,
            "pretrain_batch": pretraining.pretrain_batch,
            "pretrain_lr": pretraining.pretrain_lr,
            "cond_dropout": pretraining.cond_dropout,
            # Stored under "seed", its name when one seed drove everything, so that the
            # shipped base model keeps its file name.
            "seed": pretraining.pretrain_seed,
        }
        text = json.dumps(settings, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


_SECTIONS: dict[str, Any] = {
    field.name: typing.get_type_hints(JobConfig)[field.name]
    for field in dataclasses.fields(JobConfig)
}
"""Each section of `JobConfig` by its field name, with its class."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: where it lives in `JobConfig`, its type, default, help and bounds, and
    the values it takes when they are a fixed set (`choices`; `None` otherwise)."""

    key: str
    section: str
    field: str
    annotation: Any
    default: Any
    help: str
    bounds: dict[str, Any]
    choices: tuple[str, ...] | None

    def value(self, config: JobConfig) -> Any:
        """The setting's value in `config`."""
        return getattr(getattr(config, self.section), self.field)


SETTING_ORDER: tuple[str, ...] = (
    "width",
    "depth",
    "heads",
    "patch",
    "pretrain_steps",
    "pretrain_batch",
    "pretrain_lr",
    "cond_dropout",
    "epochs",
    "algorithm",
    "nft_beta",
    "nft_old_decay",
    "dppo_kl_threshold",
    "dppo_kl_std",
    "prompts_per_epoch",
    "groups",
    "rollout_steps",
    "train_steps",
    "sde_steps",
    "shared_noise",
    "window_schedule",
    "window_shift_every",
    "window_stride",
    "inner_epochs",
    "minibatch_rows",
    "learning_rate",
    "lr_schedule",
    "weight_decay",
    "max_grad_norm",
    "beta",
    "clip_range",
    "grpo_guard",
    "adv_clip_max",
    "noise_level",
    "guidance_scale",
    "reward",
    "reward_weights",
    "reward_combination",
    "custom_reward",
    "reward_url",
    "reward_timeout",
    "reward_retries",
    "ema_decay",
    "transition_chunk",
    "lora_rank",
    "lora_alpha",
    "eval_steps",
    "eval_samples_per_prompt",
    "eval_every",
    "preview_prompts",
    "eval_seed",
    "precision",
    "old_log_probs",
    "param_sharding",
    "fsdp_min_elements",
    "checkpoint_every",
    "keep_checkpoints",
    "log",
    "seed",
    "pretrain_seed",
)
"""The settings in the order of the flags and of `config.toml`: the order of the flat
configuration the sections replaced, so that saved files and `--help` keep their form."""


REGISTRY_CHOICES: dict[str, tuple[str, ...]] = {"algorithm": tuple(ALGORITHMS)}
"""The settings that name an entry of a registry, with its names: the flags and files take
these (the `Literal` of the setting's type, `settings.AlgorithmName`, names the same)."""


def _choices(key: str, annotation: Any) -> tuple[str, ...] | None:
    """The values setting `key` takes when they are a fixed set: a registry's names
    (`REGISTRY_CHOICES`), or those of its `Literal` type (optional or not); else `None`."""
    if key in REGISTRY_CHOICES:
        return REGISTRY_CHOICES[key]
    _, base = split_optional(annotation)
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


def _settings_table() -> dict[str, Setting]:
    """Every setting of every section, by name, in `SETTING_ORDER`.

    **Raises:**

    - `RuntimeError`: if `SETTING_ORDER` does not name every setting exactly once.
    """
    found: dict[str, Setting] = {}
    for section, section_type in _SECTIONS.items():
        hints = typing.get_type_hints(section_type)
        for field in dataclasses.fields(section_type):
            found[field.name] = Setting(
                key=field.name,
                section=section,
                field=field.name,
                annotation=hints[field.name],
                default=field.default,
                help=field.metadata["help"],
                bounds=field.metadata["bounds"],
                choices=_choices(field.name, hints[field.name]),
            )
    if sorted(found) != sorted(SETTING_ORDER):
        raise RuntimeError(f"SETTING_ORDER must name every setting once: {sorted(found)}.")
    return {key: found[key] for key in SETTING_ORDER}


SETTINGS: dict[str, Setting] = _settings_table()
"""Every setting by name, in the order of the flags and of `config.toml`."""


def setting_help(name: str) -> str:
    """The help line of setting `name`."""
    return SETTINGS[name].help


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": dict(
        width=16,
        depth=1,
        heads=2,
        patch=4,
        pretrain_steps=20,
        pretrain_batch=16,
        epochs=4,
        # A hundred times the main job's: in four epochs the held-out figures the run prints
        # (its JPEG reward and diversity) then move in their third decimal.
        learning_rate=1e-2,
        prompts_per_epoch=2,
        groups=4,
        minibatch_rows=4,
        rollout_steps=4,
        eval_steps=4,
        # Two, so that the held-out diversity is measured (it compares a prompt's samples).
        eval_samples_per_prompt=2,
        eval_every=2,
        checkpoint_every=1,
        preview_prompts=4,
        reward="jpeg_incompressibility",
    ),
}
"""Named sets of overrides: `default` (the main job) and `tiny` (a smoke run for tests)."""


class UnreadSettingWarning(UserWarning):
    """Settings a config file gives that the chosen algorithm does not read: they are left at
    their defaults (`make_config`'s `file_settings`)."""


def readers(name: str) -> list[str]:
    """The algorithms (by name) that read setting `name`.

    **Arguments:**

    - `name`: a setting's name.

    **Returns:**

    The names in `ALGORITHMS`' order: every algorithm for a setting outside
    `ALGORITHM_SETTINGS`.
    """
    return [key for key, algorithm in ALGORITHMS.items() if name in _read_by(algorithm)]


def _read_by(algorithm: AbstractAlgorithm) -> frozenset[str]:
    """Every setting `algorithm` reads: all but those of `ALGORITHM_SETTINGS` outside its
    `reads`."""
    return frozenset(SETTINGS) - (ALGORITHM_SETTINGS - algorithm.reads)


def algorithm_default(algorithm: AbstractAlgorithm, name: str) -> Any:
    """The default of setting `name` under `algorithm`: the algorithm's own
    (`default_settings`), else the setting's.

    **Arguments:**

    - `algorithm`: the algorithm.
    - `name`: a setting's name.

    **Returns:**

    The default value.
    """
    return algorithm.default_settings().get(name, SETTINGS[name].default)


def unread_settings(config: JobConfig) -> dict[str, Any]:
    """The settings of `config` that its algorithm does not read, set to other than their
    default under it.

    **Arguments:**

    - `config`: the configuration.

    **Returns:**

    `{setting: value}`, in `SETTINGS`' order.
    """
    algorithm = config.chosen_algorithm
    unread = ALGORITHM_SETTINGS - algorithm.reads
    return {
        name: value
        for name, value in config.settings().items()
        if name in unread and value != algorithm_default(algorithm, name)
    }


def _unread_message(algorithm: str, names: Mapping[str, Any] | list[str], how: str) -> str:
    """The refusal (or warning) of settings `names` that algorithm `algorithm` does not read:
    each named with its value (`how` `"at"`) and the algorithms that read it."""
    listed = []
    for name in names:
        value = f"={names[name]!r}" if isinstance(names, Mapping) else ""
        listed.append(f"`{name}`{value} (read by {', '.join(readers(name)) or 'none'})")
    one = len(listed) == 1
    subject = "Setting " if one else "Settings "
    verb = "is" if one else "are"
    if how == "file":
        return (
            f"{subject}{'; '.join(listed)} of the config file {verb} not read by algorithm "
            f"'{algorithm}': left at {'its default' if one else 'their defaults'}."
        )
    return (
        f"{subject}{'; '.join(listed)} {verb} not read by algorithm '{algorithm}': leave "
        f"{'it' if one else 'them'} out (or at the default), or choose an algorithm that "
        f"reads {'it' if one else 'them'}."
    )


def make_config(
    preset: str = "default",
    *,
    file_settings: Mapping[str, Any] | None = None,
    named: Collection[str] = (),
    **overrides: Any,
) -> JobConfig:
    """A `JobConfig` from a preset, a config file's settings and overrides, checked as a
    whole (precedence: preset < file < overrides).

    A setting the chosen algorithm does not read (`algorithms.ALGORITHM_SETTINGS` outside its
    `reads`) is refused at a value other than its default (`JobConfig`), and among `named`
    (what a user named on the command line) whatever its value; from `file_settings` (a
    run's `config.toml` holds every setting), one other than its default is left at its
    default, with one `UnreadSettingWarning` naming every such setting.

    The default reward is the weighted sum `reward_weights` (partial and strict, each
    normalised in its group); a preset or override that chooses one reward (`reward`,
    `custom_reward` or `reward_url`) without naming `reward_weights` turns it off (and
    `reward_combination` back to `"sum"` unless named too). The default shared initial noise
    is Flow-GRPO's: an algorithm may change such defaults
    (`algorithms.AbstractAlgorithm.default_settings`; `nft` samples with a deterministic
    solver, so it turns `shared_noise` off unless named).

    **Arguments:**

    - `preset`: a name of `PRESETS`.
    - `file_settings`: the settings of a config file (`read_config_file`), or `None`.
    - `named`: the settings the user named (flags), of `overrides`.
    - `overrides`: settings by name.

    **Returns:**

    The `JobConfig`.

    **Raises:**

    - `ValueError`: for an unknown preset or setting, a bad value (naming the setting), or a
        named setting the chosen algorithm does not read (naming the algorithms that do).
    """
    if preset not in PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(PRESETS)}, got {preset!r}.")
    from_file = dict(file_settings or {})
    settings = {**PRESETS[preset], **from_file, **overrides}
    chosen = settings.get("algorithm", ObjectiveSettings().algorithm)
    algorithm = ALGORITHMS.get(chosen)
    unread_named: list[str] = []
    if algorithm is not None:
        unread = ALGORITHM_SETTINGS - algorithm.reads
        unread_named = [name for name in SETTINGS if name in named and name in unread]
        ignored = {
            name: from_file[name]
            for name in SETTINGS
            if name in from_file
            and name not in overrides
            and name in unread
            and from_file[name] != algorithm_default(algorithm, name)
        }
        if ignored:
            warnings.warn(_unread_message(chosen, ignored, "file"), UnreadSettingWarning, 2)
            for name in ignored:
                del settings[name]
    if "reward_weights" not in settings and any(name in settings for name in _ONE_REWARD):
        settings.update(reward_weights=None)
        settings.setdefault("reward_combination", "sum")
    if algorithm is not None:
        for key, value in algorithm.default_settings().items():
            settings.setdefault(key, value)
    # Made first, so that what the algorithm's own checks refuse is said in their words.
    config = JobConfig.from_settings(settings)
    if unread_named:
        raise ValueError(_unread_message(chosen, unread_named, "named"))
    return config


_ONE_REWARD = ("reward", "custom_reward", "reward_url")
"""Settings that choose one reward: naming any of them (in a preset, a file or a flag) without
naming `reward_weights` turns the default weighted sum off."""


def _accepts(setting: Setting, value: Any) -> bool:
    """Whether a TOML value fits a setting (`"none"` stands for `None`): one of its
    `choices`, or a value of its type."""
    optional, base = split_optional(setting.annotation)
    if optional and value == "none":
        return True
    if setting.choices is not None:
        return value in setting.choices
    return _fits(base, value)


def _fits(annotation: Any, value: Any) -> bool:
    """Whether a TOML value fits a type other than `None`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return value in args
    if typing.get_origin(annotation) is tuple:
        return isinstance(value, list) and all(_fits(args[0], item) for item in value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _from_toml(annotation: Any, value: Any) -> Any:
    if value == "none":
        return None
    if typing.get_origin(annotation) is tuple:
        return tuple(value)
    if annotation is float:
        return float(value)
    return value


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings a TOML file gives (a flat table of setting names; `"none"` for none).

    **Arguments:**

    - `path`: the `.toml` file, e.g. a run folder's `config.toml`.

    **Returns:**

    `{setting: value}` for the settings the file names.

    **Raises:**

    - `ValueError`: naming the file (and the key), for a file that cannot be read, is not
        UTF-8 text or not TOML, names an unknown setting, or gives a value of the wrong
        type.
    """
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except UnicodeDecodeError as error:
        bad = error.object[error.start : error.end].hex(" ")
        raise ValueError(
            f"Config file {os.fspath(path)!r} is not UTF-8 text (byte(s) 0x{bad} at offset "
            f"{error.start}): a config file is TOML text, as `flowgrpo-eqx train` writes a "
            "run's config.toml (see --print-config)."
        ) from error
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"Config file {os.fspath(path)!r}: {error}") from error
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in SETTINGS:
            raise ValueError(
                f"Config file {os.fspath(path)!r}: unknown setting {key!r}; known: "
                f"{sorted(SETTINGS)}."
            )
        annotation = SETTINGS[key].annotation
        if not _accepts(SETTINGS[key], value):
            raise ValueError(
                f"Config file {os.fspath(path)!r}: setting {key!r} = {value!r} is not of type "
                f"{annotation}."
            )
        values[key] = _from_toml(annotation, value)
    return values


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"No TOML form for {value!r}.")


def config_to_toml(config: JobConfig) -> str:
    """The whole configuration as TOML, one setting per line with its help as a comment.

    `read_config_file` of the text gives back the same configuration.
    """
    lines = ["# flowgrpo-eqx train --config THIS_FILE reproduces the run's settings."]
    for key, setting in SETTINGS.items():
        lines.append(f"# {setting.help}")
        lines.append(f"{key} = {_toml_value(setting.value(config))}")
    return "\n".join(lines) + "\n"
