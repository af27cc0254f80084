"""How `flowgrpo-eqx finetune` reads what a pipeline folder's files say beyond the weights: the
FLUX scheduler's dynamic shift, and the prompt cleaning `WanPipeline` applies."""

import json
import math
import pathlib
import shutil

import pytest

from flowgrpo_eqx.finetune import read_config
from flowgrpo_eqx.finetune._pipeline import PIPELINE_KINDS, wan_prompt_clean

from .finetune_helpers import PIPELINES, tiny_table, write_config


@pytest.mark.parametrize(
    ("prompt", "cleaned"),
    [
        ("  a  cat\tand\na dog  ", "a cat and a dog"),
        ("fish &amp;amp; chips", "fish & chips"),  # unescaped twice, as diffusers does
        ("a &lt;b&gt; tag", "a <b> tag"),
        ("plain", "plain"),
    ],
)
def test_wan_prompts_are_cleaned_as_the_pipeline_cleans_them(prompt: str, cleaned: str) -> None:
    assert wan_prompt_clean(prompt) == cleaned


def test_flux_dynamic_shift_reads_the_schedulers_fields(tmp_path: pathlib.Path) -> None:
    """`FluxPipeline`'s `calculate_shift` with the folder's `base_image_seq_len`,
    `max_image_seq_len`, `base_shift` and `max_shift`: mu linear in the token count, the shift
    exp(mu)."""
    folder = tmp_path / "flux_dev"
    shutil.copytree(PIPELINES / "flux_dev", folder)
    path = folder / "scheduler" / "scheduler_config.json"
    scheduler = json.loads(path.read_text())
    scheduler.update(
        use_dynamic_shifting=True,
        base_image_seq_len=4,
        max_image_seq_len=64,
        base_shift=0.25,
        max_shift=1.5,
    )
    path.write_text(json.dumps(scheduler))
    table = tiny_table(tmp_path, "flux_dev", pipeline={"path": str(folder)})
    config = read_config(write_config(tmp_path / "run.toml", table)).resolved()
    kind = PIPELINE_KINDS[config.kind]
    height, width, _ = kind.latent_shape(config, folder)
    tokens = (height // 2) * (width // 2)
    slope = (1.5 - 0.25) / (64 - 4)
    expected = math.exp(slope * tokens + (0.25 - slope * 4))
    assert kind.process(folder, config).shift == pytest.approx(expected, rel=1e-12)
