"""`flowgrpo-eqx finetune` given bad input: each mistake gets an error that names the setting or
the file and what was expected, raised before the run folder is written (or, for a reward that
fails while training, with the folder's checkpoints kept)."""

import json
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from flowgrpo_eqx import RewardError
from flowgrpo_eqx.finetune import (
    MeshPlanError,
    PipelineError,
    PromptsError,
    RewardSetupError,
    read_config,
    run_finetune,
)
from flowgrpo_eqx.train import RunFolderError

from .cli_helpers import compilation_cache
from .finetune_helpers import PIPELINES, tiny_table, write_config


def _pipeline_copy(tmp_path: pathlib.Path, kind: str = "sd35") -> pathlib.Path:
    copy = tmp_path / f"{kind}_copy"
    shutil.copytree(PIPELINES / kind, copy)
    return copy


def _run(
    tmp_path: pathlib.Path, table: dict[str, Any], overrides: tuple[str, ...] = (), **flags: Any
) -> dict[str, Any]:
    config = read_config(write_config(tmp_path / "run.toml", table), list(overrides))
    with compilation_cache():
        return run_finetune(config, tmp_path / "run", quiet=True, log=lambda _: None, **flags)


def _not_a_pipeline(tmp: pathlib.Path) -> tuple[str, ...]:
    (tmp / "plain").mkdir()
    return (f"pipeline.path='{tmp / 'plain'}'",)


def _missing_subfolder(tmp: pathlib.Path) -> tuple[str, ...]:
    copy = _pipeline_copy(tmp)
    shutil.rmtree(copy / "vae")
    return (f"pipeline.path='{copy}'",)


def _another_pipeline(tmp: pathlib.Path) -> tuple[str, ...]:
    copy = _pipeline_copy(tmp)
    index = json.loads((copy / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionXLPipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    return (f"pipeline.path='{copy}'",)


def _tokenizer_missing(tmp: pathlib.Path) -> tuple[str, ...]:
    copy = _pipeline_copy(tmp)
    (copy / "tokenizer" / "merges.txt").unlink()
    return (f"pipeline.path='{copy}'",)


def _tokenizer_corrupt(tmp: pathlib.Path) -> tuple[str, ...]:
    copy = _pipeline_copy(tmp)
    (copy / "tokenizer_2" / "vocab.json").write_text('{"a": 0, "b"')
    return (f"pipeline.path='{copy}'",)


def _bin_weights(tmp: pathlib.Path) -> tuple[str, ...]:
    copy = _pipeline_copy(tmp)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_name("diffusion_pytorch_model.bin"))
    return (f"pipeline.path='{copy}'",)


def _empty_prompts(tmp: pathlib.Path) -> tuple[str, ...]:
    (tmp / "empty.txt").write_text("\n  \n")
    return (f"prompts.train='{tmp / 'empty.txt'}'",)


def _bad_jsonl(tmp: pathlib.Path) -> tuple[str, ...]:
    (tmp / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog",\n')
    return (f"prompts.heldout='{tmp / 'bad.jsonl'}'",)


def _jsonl_without_prompt(tmp: pathlib.Path) -> tuple[str, ...]:
    (tmp / "bad.jsonl").write_text('{"prompt": "a cat"}\n\n{"caption": "a dog"}\n')
    return (f"prompts.train='{tmp / 'bad.jsonl'}'",)


def _wrong_reward_model(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return (f"reward.pickscore.model='{PIPELINES / 'sd35' / 'text_encoder'}'",)


def _reward_server_down(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("reward.pickscore={kind='http', url='http://127.0.0.1:9'}",)


def _python_reward_missing(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("reward.pickscore={kind='python', function='tests.finetune_rewards:no_such'}",)


def _mesh_devices(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("mesh.devices=64",)


def _batch_not_dividing(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("sampling.batch=3",)


def _train_batch_not_dividing(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("training.batch=3",)


def _resolution(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return ("sampling.resolution=18",)  # the tiny VAE downsamples by 2: multiples of 4


def _wan_frames(tmp: pathlib.Path) -> tuple[str, ...]:
    del tmp
    return (f"pipeline.path='{PIPELINES / 'wan'}'", "sampling.frames=4")


CASES: list[tuple[Callable[[pathlib.Path], tuple[str, ...]], type[Exception], str]] = [
    (_not_a_pipeline, PipelineError, r"plain is not a diffusers pipeline folder: it has no "
     r"model_index.json"),
    (_missing_subfolder, PipelineError, r"sd35_copy has no vae/ folder"),
    (_another_pipeline, PipelineError, r"names the pipeline 'StableDiffusionXLPipeline', which "
     r"finetune does not train"),
    (_tokenizer_missing, PipelineError, r"tokenizer cannot be read: .*merges.txt"),
    (_tokenizer_corrupt, PipelineError, r"tokenizer_2 cannot be read: .*vocab.json"),
    (_bin_weights, PipelineError, r"transformer holds no safetensors weights: it holds a "
     r"PyTorch .bin checkpoint.*SD3Transformer2DModel.from_pretrained"),
    (_empty_prompts, PromptsError, r"`prompts.train`: .*empty.txt holds no prompt"),
    (_bad_jsonl, PromptsError, r"`prompts.heldout`: .*bad.jsonl line 2 is not JSON"),
    (_jsonl_without_prompt, PromptsError, r"bad.jsonl line 3 has no string \"prompt\""),
    (_wrong_reward_model, RewardSetupError, r"`reward.pickscore.model` .*text_encoder\) holds "
     r"a CLIPTextModel, not the CLIPModel"),
    (_reward_server_down, RewardSetupError, r"reward server at http://127.0.0.1:9 does not "
     r"answer"),
    (_python_reward_missing, RewardSetupError, r"`reward.pickscore.function`.*no_such"),
    (_mesh_devices, MeshPlanError, r"`mesh.devices`=64 must be at most"),
    (_batch_not_dividing, MeshPlanError, r"`sampling.batch`=3 .* must divide an epoch's 4 "
     r"samples"),
    (_train_batch_not_dividing, MeshPlanError, r"`training.batch`=3 .* must divide an "
     r"update's 2 samples"),
    (_resolution, PipelineError, r"`sampling.height` \(or `sampling.resolution`\) = 18 must be "
     r"a multiple of 4: the VAE downsamples by 2"),
    (_wan_frames, PipelineError, r"`sampling.frames` = 4 must be 1 \+ 4k"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "error", "message"), CASES, ids=[c[0].__name__ for c in CASES])
def test_a_bad_input_is_named_before_anything_is_written(
    tmp_path: pathlib.Path,
    make: Callable[[pathlib.Path], tuple[str, ...]],
    error: type[Exception],
    message: str,
) -> None:
    overrides = make(tmp_path)
    with pytest.raises(error, match=message):
        _run(tmp_path, tiny_table(tmp_path, "sd35"), overrides)
    assert not (tmp_path / "run").exists(), "nothing is written before the input is checked"


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("nan_reward", r"non-finite scores"),
        ("one_short", r"returned shape \(3,\); expected one score per sample, \[N\] = \(4,\)"),
    ],
)
def test_a_reward_that_fails_in_training_is_named(
    tmp_path: pathlib.Path, function: str, message: str
) -> None:
    rewards = {"bad": {"kind": "python", "function": f"tests.finetune_rewards:{function}"}}
    table = tiny_table(tmp_path, "sd35", rewards=rewards, evaluation={"before": False})
    with pytest.raises(RewardError, match=message):
        _run(tmp_path, table)


def test_a_run_folder_of_another_configuration_is_refused(tmp_path: pathlib.Path) -> None:
    table = tiny_table(tmp_path, "sd35", training={"epochs": 1}, evaluation={"before": False})
    _run(tmp_path, table)
    with pytest.raises(RunFolderError, match=r"holds another run. Continue it with `.* --resume`"):
        _run(tmp_path, table)
    with pytest.raises(
        RunFolderError,
        match=r"`training.learning_rate`: 0.0003 in the checkpoint, 0.1 now",
    ):
        _run(tmp_path, table, ("training.learning_rate=0.1", "training.epochs=2"), resume=True)
    with pytest.raises(RunFolderError, match=r"`--resume` and `--replace` exclude each other"):
        _run(tmp_path, table, resume=True, replace=True)


def test_a_resume_with_nothing_saved_says_how_to_start_over(tmp_path: pathlib.Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 0}\n')
    table = tiny_table(tmp_path, "sd35")
    with pytest.raises(RunFolderError, match=r"nothing was saved to continue.*--replace`"):
        _run(tmp_path, table, resume=True)
