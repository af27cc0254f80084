"""`flowgrpo-eqx finetune`'s assembly of a published pipeline computes what diffusers' pipeline
computes with it, end to end.

The reference is `tests/data/pipelines/<name>_io.npz` (`tools/make_pipeline_fixtures.py`, run
by hand with diffusers 0.42.1): each tiny pipeline's two-step output for two prompts from fixed
initial latents, before decoding (`output_type="latent"`) and decoded (`"np"`), with every
argument of the call in `<name>_io.json`.

For SD3.5, FLUX.1-dev and FLUX.1-schnell the run's flow is built as `finetune` builds it: a
configuration read from TOML pointing at the pipeline folder with the call's size, text length,
guidance scale and steps; `load_pipeline`; the prompts embedded by the pipeline's text side
and the negative prompt's row (the pipelines' default, `""`) where the kind guides with it;
`Job.build` with no reward term; the evaluation policy of a fresh trainer state; then
`evaluation_program` (the held-out evaluation's program: Euler on the kind's grid, the
guidance, the VAE) from the fixture's initial latents in our channels-last layout (FLUX's
unpacked from `FluxPipeline`'s packing). Its latents and images are diffusers'
(`output_type="np"` is `[0, 1]`, ours `[-1, 1]`).

Wan: `WanPipeline` samples with `UniPCMultistepScheduler`, which finetune does not use (it
samples Euler on `RectifiedFlow(shift=flow_shift)`), so its end-to-end output is no reference
for the run's sampler. What the run takes from the pipeline is checked instead: the prompts'
rows and the negative prompt's null row are `encode_prompt`'s, and the run's decoder gives
diffusers' video of the pipeline's final latents.
"""

import json
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx import Euler
from flowgrpo_eqx.finetune import read_config
from flowgrpo_eqx.finetune._job import Job, evaluation_program
from flowgrpo_eqx.finetune._pipeline import load_pipeline
from flowgrpo_eqx.finetune._plan import MeshPlan
from tests.diffusers_helpers import relative
from tests.tolerances import reference_model_rtol


pytest.importorskip("tokenizers", reason="the pipelines' tokenizers are read with it")

PIPELINES = pathlib.Path(__file__).resolve().parent / "data" / "pipelines"
REWARDS = PIPELINES / "rewards"


def _toml(value: Any) -> str:
    return json.dumps(str(value)) if isinstance(value, str | pathlib.Path) else repr(value)


def _config_text(name: str, call: dict[str, Any], prompts: pathlib.Path) -> str:
    """A finetune configuration of the pipeline `name` at the pipeline call's settings."""
    sampling = {
        "height": call["height"],
        "width": call["width"],
        "train_steps": call["num_inference_steps"],
        "eval_steps": call["num_inference_steps"],
        "guidance_scale": float(call["guidance_scale"]),
    }
    if "num_frames" in call:
        sampling["frames"] = call["num_frames"]
    lines = [
        "[pipeline]",
        f"path = {_toml(PIPELINES / name)}",
        'dtype = "float32"',
        "[prompts]",
        f"train = {_toml(prompts)}",
        f"text_length = {call['max_sequence_length']}",
        # The pipelines' default negative prompt (`negative_prompt=None` is `""`).
        'negative = ""',
        "[sampling]",
        *(f"{key} = {_toml(value)}" for key, value in sampling.items()),
        "[precision]",
        'compute = "float32"',
        # A configuration names a reward; the job here is built with no term.
        "[reward.pickscore]",
        f"model = {_toml(REWARDS / 'pickscore')}",
        f"processor = {_toml(REWARDS / 'processor')}",
    ]
    return "\n".join(lines) + "\n"


def _built(name: str, folder: pathlib.Path) -> dict[str, Any]:
    """The run's pipeline, rows, null row, job and evaluation policy, as finetune builds them,
    with the fixture."""
    record = json.loads((PIPELINES / f"{name}_io.json").read_text())
    call = record["arguments"]["call"]
    prompts = folder / "prompts.txt"
    prompts.write_text("\n".join(record["prompts"]) + "\n")
    path = folder / "config.toml"
    path.write_text(_config_text(name, call, prompts))
    config = read_config(path).resolved()
    pipeline = load_pipeline(config)
    rows = pipeline.text.embed(list(record["prompts"]))
    null = pipeline.text.embed([config.prompts.negative]) if pipeline.needs_null else None
    job = Job.build(config, MeshPlan.of(config), pipeline, null, [], [], None)
    state = job.trainer.init(jax.random.key(config.seed + 2))
    return {
        "io": dict(np.load(PIPELINES / f"{name}_io.npz")),
        "call": call,
        "config": config,
        "pipeline": pipeline,
        "rows": rows,
        "null": null,
        "job": job,
        "policy": job.evaluation_policy(state),
    }


def _unpack(packed: np.ndarray, height: int, width: int) -> np.ndarray:
    """`FluxPipeline._unpack_latents` in NumPy, channels-last: `[B, (h/2)(w/2), 4 C]` tokens
    of 2 x 2 patches (channel-major within a patch) to `[B, h, w, C]`, `h`, `w` the latent's."""
    batch, _, features = packed.shape
    patches = packed.reshape(batch, height // 2, width // 2, features // 4, 2, 2)
    return patches.transpose(0, 1, 4, 2, 5, 3).reshape(batch, height, width, features // 4)


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape
    assert relative(got, want) < reference_model_rtol()


@pytest.fixture(scope="module", params=["sd35", "flux_dev", "flux_schnell"])
def image_run(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """An image pipeline's run parts, and its evaluation from the fixture's initial latents."""
    name = request.param
    built = _built(name, tmp_path_factory.mktemp(name))
    io, job = built["io"], built["job"]
    latents = io["latents"]
    if name.startswith("flux"):
        side = built["call"]["height"] // 2  # the fixture VAE's latent is half the image
        noise = _unpack(latents, side, side)
        np.testing.assert_array_equal(noise, np.moveaxis(io["latents_unpacked"], 1, -1))
    else:
        noise = np.moveaxis(latents, 1, -1)
    steps = built["config"].sampling.eval_steps + 1  # time points, as `_Run.evaluate`
    rows = {key: jnp.asarray(value) for key, value in built["rows"].items()}
    samples, scores = evaluation_program(
        job.flow, steps, built["policy"], rows, jnp.asarray(noise), []
    )
    assert scores == {}
    # The latents the program decoded: its own first half, `sample_latents`.
    final = eqx.filter_jit(
        lambda flow, policy, rows, noise: flow.sample_latents(policy, rows, noise, Euler(), steps)
    )(job.flow, built["policy"], rows, jnp.asarray(noise))
    return {**built, "name": name, "steps": steps, "samples": samples, "final": final}


def test_the_rows_are_encode_prompts(image_run: dict[str, Any]) -> None:
    io, rows = image_run["io"], image_run["rows"]
    _close(rows["context"], io["prompt_embeds"])
    _close(rows["pooled"], io["pooled_prompt_embeds"])
    null = image_run["null"]
    if image_run["name"] == "sd35":
        assert null is not None
        _close(null["context"][0], io["negative_prompt_embeds"][0])
        _close(null["pooled"][0], io["negative_pooled_prompt_embeds"][0])
    else:  # FLUX.1 guides without a negative prompt
        assert null is None


def test_the_grid_is_the_schedulers(image_run: dict[str, Any]) -> None:
    grid = image_run["job"].flow.process.timesteps(image_run["steps"])
    np.testing.assert_allclose(np.asarray(grid), image_run["io"]["sigmas"], rtol=1e-6, atol=0)


def test_the_latents_are_the_pipelines(image_run: dict[str, Any]) -> None:
    io, final = image_run["io"], np.asarray(image_run["final"])
    if image_run["name"].startswith("flux"):
        want = _unpack(io["output_latent"], *final.shape[1:3])
    else:
        want = np.moveaxis(io["output_latent"], 1, -1)
    _close(final, want)


def test_the_images_are_the_pipelines(image_run: dict[str, Any]) -> None:
    # diffusers' `output_type="np"`: `(image / 2 + 0.5).clamp(0, 1)`; ours is `[-1, 1]`.
    _close(np.asarray(image_run["samples"]) / 2 + 0.5, image_run["io"]["output_np"])


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory: Any) -> dict[str, Any]:
    return _built("wan", tmp_path_factory.mktemp("wan"))


def test_wan_rows_and_null_row_are_encode_prompts(wan_run: dict[str, Any]) -> None:
    io = wan_run["io"]
    # The fixture's prompts are the same after WanPipeline's cleaning (whitespace, no ftfy).
    _close(wan_run["rows"]["context"], io["prompt_embeds"])
    assert wan_run["null"] is not None
    _close(wan_run["null"]["context"][0], io["negative_prompt_embeds"][0])
    null_row = wan_run["job"].flow.inputs.null
    _close(null_row, io["negative_prompt_embeds"][0])


def test_wan_decodes_the_pipelines_latents_to_its_video(wan_run: dict[str, Any]) -> None:
    io, flow = wan_run["io"], wan_run["job"].flow
    latents = np.moveaxis(io["output_latent"], 1, -1)  # [B, C, F, H, W] -> [B, F, H, W, C]
    assert latents.shape[1:] == wan_run["pipeline"].latent_shape
    video = eqx.filter_jit(lambda flow, x: flow.decode(x))(flow, jnp.asarray(latents))
    _close(np.asarray(video) / 2 + 0.5, io["output_np"])
