"""Fixtures showing diffusers loading what `flowgrpo-eqx finetune` exports, made with diffusers
itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), the
library and its tests never import torch; this script has two commands, run by hand:

    .venv/bin/python tools/make_export_fixtures.py export /tmp/export-out
    /work/venv-torch/bin/python tools/make_export_fixtures.py check /tmp/export-out

`export OUT` (the project's environment, with JAX), for each tiny pipeline of
`tests/data/pipelines/` (`sd35`, `flux_dev`, `flux_schnell`, `wan`; made by
`tools/make_pipeline_fixtures.py`):

- reads a small finetune configuration (`CONFIG`: the pipeline folder, float32 weights, the
    fixture's image size and `text_length`, LoRA rank 2 and alpha 64 on the kind's default
    targets) with `read_config(...).resolved()`;
- loads the transformer as finetune does (`PIPELINE_KINDS[kind].transformer(folder,
    config)`) and builds the policy as finetune does (`_job.make_policy`), then gives every
    adapter a nonzero `b` drawn from a fixed JAX key (`policy`: finetune's `b` starts at zero,
    and an adapter of zeros would show nothing). The exported files must be the same bytes
    wherever the test rebuilds them, and a float draw is not: `jax.random.normal`'s last bits
    follow the compiler's contractions (XLA's -O0 of the tests and its default differ). So `b`
    is integers from `jax.random.randint` (integer arithmetic alone) times `2 ** -14`, and
    finetune's `a` is rounded to multiples of `2 ** -8`: every product in `b @ a`, and their
    sum, is exact in float32, `lora.merge` rounds each merged weight once, and only a draw of
    `a` within its last bit of a rounding boundary could differ;
- writes `export_policy(policy, OUT/<name>, dtype="float32")` (`OUT/<name>/lora` and
    `OUT/<name>/transformer`, as at the end of a run) and `OUT/<name>/ours.npz`: the inputs
    (`inputs`: the fixture's initial latents channels-last, `t` 0.9 and 0.27, the prompts'
    embeddings of `<name>_io.npz`, FLUX.1-dev's guidance 3.5) and our velocity of the policy
    on them (`v`).

`check OUT` (torch venv: diffusers 0.42.1, peft) loads, for each pipeline,
`OUT/<name>/transformer` with the transformer class's `from_pretrained`, and separately the base
pipeline folder with the pipeline class's `from_pretrained` and `pipe.load_lora_weights(
OUT/<name>/lora)`; computes both transformers' outputs on the inputs (called as each
pipeline calls its transformer: SD3's and Wan's timestep `1000 t`; FLUX's latents packed 2 x 2,
`img_ids`, zero `txt_ids`, timestep `t` and the guidance scale); and checks, relative to the
largest `|v|`, that they agree with each other to 1e-5 and with `ours.npz` to 1e-4, that the
adapters moved the base's output, that diffusers and peft logged no warning while loading (an
unexpected or ignored key would), and that the adapters diffusers holds are every key of the
file, with its values. It writes `tests/data/pipelines/<name>_export.npz`: the inputs,
`v_transformer` and `v_lora` (diffusers' two outputs), `lora_keys` (the keys diffusers took,
sorted), `load_warnings` (what diffusers logged while loading: SD3's and FLUX's loaders note
that the file has no key for a text encoder, and nothing else may be logged), `versions`, and
`digest_lora` / `digest_transformer` (`tensors_digest` of each exported folder), which
`tests/test_finetune_export.py` checks our export against.
"""

import hashlib
import json
import pathlib
import re
import sys
import tempfile
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from flowgrpo_eqx.finetune._kinds import ModelKind


ROOT = pathlib.Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "tests" / "data" / "pipelines"
NAMES = ("sd35", "flux_dev", "flux_schnell", "wan")
KINDS: dict[str, "ModelKind"] = {
    "sd35": "sd3",
    "flux_dev": "flux-dev",
    "flux_schnell": "flux-schnell",
    "wan": "wan",
}
TIMES = (0.9, 0.27)
FLUX_GUIDANCE = 3.5
B_KEY = 88  # the fixed key of the adapters' `b` (issue 88)
B_UNIT = 2.0**-14  # `b` is integers in [-128, 128) times this, |b| about 0.004: with alpha /
# rank = 32 and finetune's `a` (std 1 / rank), the adapters move diffusers' output by 0.3 to 0.7
# of its largest value
A_UNIT = 2.0**-8  # finetune's `a` rounded to multiples of this

CONFIG = """\
[pipeline]
path = {folder}
dtype = "float32"

[prompts]
train = {prompts}
text_length = 16

[sampling]
{size}

[lora]
rank = 2
alpha = 64.0

[precision]
compute = "float32"

[reward.pickscore]
kind = "pickscore"
model = {pickscore}
processor = {processor}
"""
"""The configuration of a run on a fixture pipeline (`config`). The reward is named (a
configuration needs one) but not read here."""


def config_text(name: str, prompts: pathlib.Path) -> str:
    """The TOML of a finetune run on the fixture pipeline `name`: its folder, float32, its
    image size (16 x 16; Wan's 5 frames of 32 x 32) and `text_length` 16 (the fixtures'
    `max_sequence_length`), LoRA rank 2 with the default alpha on the kind's targets."""
    size = "resolution = 32\nframes = 5" if name == "wan" else "resolution = 16"
    rewards = PIPELINES / "rewards"
    return CONFIG.format(
        folder=json.dumps(str(PIPELINES / name)),
        prompts=json.dumps(str(prompts)),
        size=size,
        pickscore=json.dumps(str(rewards / "pickscore")),
        processor=json.dumps(str(rewards / "processor")),
    )


def config(name: str, folder: pathlib.Path, extra: str = "") -> Any:
    """`read_config(...).resolved()` of `config_text(name)` (plus `extra` TOML lines), the file
    and its prompts written in `folder`."""
    from flowgrpo_eqx.finetune import read_config

    prompts = folder / f"{name}_prompts.txt"
    prompts.write_text("a photo of a cat\n")
    path = folder / f"{name}.toml"
    path.write_text(config_text(name, prompts) + extra)
    return read_config(path).resolved()


def policy(name: str, settings: Any) -> Any:
    """The policy a run on `name` starts from (finetune's loader and `make_policy`), with
    every adapter's `b` drawn from `B_KEY` and its `a` rounded (exact products: module
    docstring)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from flowgrpo_eqx import lora
    from flowgrpo_eqx.finetune._job import make_policy
    from flowgrpo_eqx.finetune._pipeline import PIPELINE_KINDS

    transformer = PIPELINE_KINDS[KINDS[name]].transformer(PIPELINES / name, settings)
    made = make_policy(transformer, settings)
    keys = iter(jax.random.split(jax.random.key(B_KEY), len(made.adapters)))

    def draw(adapter: Any) -> Any:
        a = jnp.round(adapter.a / A_UNIT) * A_UNIT
        steps = jax.random.randint(next(keys), adapter.b.shape, -128, 128)
        b = steps.astype(jnp.float32) * B_UNIT
        return lora.LoraAdapter(a.astype(adapter.a.dtype), b.astype(adapter.b.dtype))

    drawn = tuple(draw(adapter) for adapter in made.adapters)
    return eqx.tree_at(lambda p: p.adapters, made, drawn)


def inputs(name: str) -> dict[str, Any]:
    """The fixed inputs, in our conventions: `x` the fixture's initial latents channels-last
    (FLUX's unpacked), `t`, and the condition's fields (`context`, `pooled`, `guidance`)."""
    import numpy as np

    io = dict(np.load(PIPELINES / f"{name}_io.npz"))
    latents = io["latents_unpacked"] if name.startswith("flux") else io["latents"]
    out = {
        "x": np.moveaxis(latents, 1, -1),
        "t": np.asarray(TIMES, np.float32),
        "context": io["prompt_embeds"],
    }
    if name != "wan":
        out["pooled"] = io["pooled_prompt_embeds"]
    if name == "flux_dev":
        out["guidance"] = np.full(len(TIMES), FLUX_GUIDANCE, np.float32)
    return {key: np.ascontiguousarray(value, np.float32) for key, value in out.items()}


def velocity(model: Any, values: dict[str, Any]) -> Any:
    """Our velocity of `model` (a transformer or a LoRA policy) on `inputs`."""
    import equinox as eqx
    import jax
    import numpy as np

    cond = (
        values["context"]
        if "pooled" not in values
        else {k: values[k] for k in ("context", "pooled", "guidance") if k in values}
    )
    v = eqx.filter_jit(lambda m, x, t, c: jax.vmap(m)(x, t, c))(
        model, values["x"], values["t"], cond
    )
    return np.asarray(v)


def tensors_digest(folder: pathlib.Path) -> str:
    """The sha256 of every tensor of the `.safetensors` files under `folder`: each tensor's
    name, dtype, shape and bytes, in the order of the names. Read from the files' headers
    (no framework): the files' metadata, and where in a file each tensor lies, do not
    count."""
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for file in sorted(folder.rglob("*.safetensors")):
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        body = data[8 + size :]
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if key in tensors:
                raise ValueError(f"{file}: the tensor {key} is in two files")
            start, end = entry["data_offsets"]
            tensors[key] = (entry["dtype"], list(entry["shape"]), body[start:end])
    digest = hashlib.sha256()
    for key in sorted(tensors):
        dtype, shape, raw = tensors[key]
        digest.update(json.dumps([key, dtype, shape]).encode() + b"\0")
        digest.update(raw)
    return digest.hexdigest()


def export(out: pathlib.Path) -> None:
    import numpy as np

    from flowgrpo_eqx.finetune._export import export_policy

    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            made = policy(name, config(name, pathlib.Path(tmp)))
            export_policy(made, out / name, dtype="float32")
            values = inputs(name)
            v = velocity(made, values)
            np.savez(out / name / "ours.npz", v=v, **values)
            print(name, "exported", len(made.layer_paths), "adapted layers", v.shape)


def _diffusers_velocity(name: str, model: Any, values: dict[str, Any]) -> Any:
    """diffusers' output for our channels-last inputs, called as the pipeline calls its
    transformer, channels-last."""
    import torch
    from diffusers import FluxPipeline

    t = torch.from_numpy(values["t"])
    context = torch.from_numpy(values["context"])
    with torch.no_grad():
        if name == "sd35":
            out = model(
                hidden_states=torch.from_numpy(values["x"]).permute(0, 3, 1, 2),
                encoder_hidden_states=context,
                pooled_projections=torch.from_numpy(values["pooled"]),
                timestep=1000 * t,
                return_dict=False,
            )[0]
            return out.permute(0, 2, 3, 1).numpy()
        if name == "wan":
            out = model(
                hidden_states=torch.from_numpy(values["x"]).permute(0, 4, 1, 2, 3),
                encoder_hidden_states=context,
                timestep=1000 * t,
                return_dict=False,
            )[0]
            return out.permute(0, 2, 3, 4, 1).numpy()
        batch, height, width, channels = values["x"].shape
        latents = torch.from_numpy(values["x"]).permute(0, 3, 1, 2)
        packed = FluxPipeline._pack_latents(latents, batch, channels, height, width)
        img_ids = FluxPipeline._prepare_latent_image_ids(
            batch, height // 2, width // 2, "cpu", torch.float32
        )
        guidance = values.get("guidance")
        out = model(
            hidden_states=packed,
            encoder_hidden_states=context,
            pooled_projections=torch.from_numpy(values["pooled"]),
            timestep=t,
            guidance=None if guidance is None else torch.from_numpy(guidance),
            img_ids=img_ids,
            txt_ids=torch.zeros(context.shape[1], 3),
            return_dict=False,
        )[0]
        unpacked = FluxPipeline._unpack_latents(out, 8 * height, 8 * width, 8)
        return unpacked.permute(0, 2, 3, 1).numpy()


class _Captured:
    """Every log record of WARNING or above from diffusers, peft and transformers, and every
    Python warning, while it is entered."""

    def __enter__(self) -> list[str]:
        import logging
        import warnings

        self.messages: list[str] = []
        messages = self.messages

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                messages.append(f"{record.name}: {record.getMessage()}")

        self.handler = Handler(logging.WARNING)
        self.loggers = [logging.getLogger(n) for n in ("diffusers", "peft", "transformers")]
        for logger in self.loggers:
            logger.addHandler(self.handler)
        self.warnings = warnings.catch_warnings(record=True)
        self.caught = self.warnings.__enter__()
        warnings.simplefilter("always")
        return messages

    def __exit__(self, *exc: Any) -> None:
        self.warnings.__exit__(*exc)
        for logger in self.loggers:
            logger.removeHandler(self.handler)
        self.messages += [f"{w.category.__name__}: {w.message}" for w in self.caught]


_NO_TEXT_ENCODER_KEYS = re.compile(
    r"diffusers\.loaders\.lora_base: No LoRA keys associated to \w+ found with the "
    r"prefix='text_encoder(_\d)?'\. "
)
"""diffusers' note that a LoRA file holds no key of a text encoder's."""


def check(out: pathlib.Path) -> None:
    import diffusers
    import numpy as np
    import peft
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import load_file

    classes = {
        "sd35": (diffusers.StableDiffusion3Pipeline, diffusers.SD3Transformer2DModel),
        "flux_dev": (diffusers.FluxPipeline, diffusers.FluxTransformer2DModel),
        "flux_schnell": (diffusers.FluxPipeline, diffusers.FluxTransformer2DModel),
        "wan": (diffusers.WanPipeline, diffusers.WanTransformer3DModel),
    }

    def error(got: Any, want: Any) -> float:
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    worst = {"diffusers": 0.0, "ours": 0.0}
    for name in NAMES:
        pipeline_class, transformer_class = classes[name]
        folder = out / name
        ours = dict(np.load(folder / "ours.npz"))
        values = {key: value for key, value in ours.items() if key != "v"}
        merged = transformer_class.from_pretrained(folder / "transformer").eval()
        pipe = pipeline_class.from_pretrained(PIPELINES / name)
        base = _diffusers_velocity(name, pipe.transformer.eval(), values)
        with _Captured() as messages:
            pipe.load_lora_weights(folder / "lora")
        # The one warning allowed: the file has no keys for a text encoder (SD3's loader
        # looks for them; finetune adapts the transformer alone).
        others = [m for m in messages if not _NO_TEXT_ENCODER_KEYS.match(m)]
        assert not others, f"{name}: loading the adapters warned: {others}"
        written = load_file(folder / "lora" / "pytorch_lora_weights.safetensors")
        (adapter,) = pipe.transformer.peft_config  # the one adapter load_lora_weights made
        held = {
            f"transformer.{key}": value.numpy()
            for key, value in get_peft_model_state_dict(
                pipe.transformer, adapter_name=adapter
            ).items()
        }
        assert sorted(held) == sorted(written), (name, sorted(set(held) ^ set(written)))
        for key, value in written.items():
            np.testing.assert_array_equal(held[key], value, err_msg=f"{name}: {key}")
        v_transformer = _diffusers_velocity(name, merged, values)
        v_lora = _diffusers_velocity(name, pipe.transformer.eval(), values)
        checks = {
            "diffusers: exported transformer vs base pipeline + load_lora_weights": (
                v_transformer,
                v_lora,
            ),
            "ours: policy vs diffusers' exported transformer": (ours["v"], v_transformer),
            "ours: policy vs diffusers' base pipeline + load_lora_weights": (ours["v"], v_lora),
        }
        for label, (got, want) in checks.items():
            e = error(got, want)
            side = label.split(":")[0]
            worst[side] = max(worst[side], e)
            print(f"{name} {label}: max |error| / max |v| = {e:.2e}")
        moved = error(base, v_lora)
        print(f"{name}: the adapters move diffusers' output by {moved:.2e} of max |v|")
        assert moved > 1e-2, f"{name}: the adapters changed nothing"
        versions = {
            "diffusers": diffusers.__version__,
            "peft": peft.__version__,
            "torch": torch.__version__,
        }
        np.savez_compressed(
            PIPELINES / f"{name}_export.npz",
            **values,
            v_transformer=v_transformer,
            v_lora=v_lora,
            lora_keys=np.asarray(sorted(held)),
            digest_lora=np.asarray(tensors_digest(folder / "lora")),
            digest_transformer=np.asarray(tensors_digest(folder / "transformer")),
            versions=np.asarray(json.dumps(versions, sort_keys=True)),
            load_warnings=np.asarray(messages, dtype=str),
        )
        print(name, len(held), "LoRA keys accepted; warnings:", messages or "none")
    # Within diffusers (same framework, same weights) to 1e-5; across frameworks to 1e-4.
    assert worst["diffusers"] < 1e-5 and worst["ours"] < 1e-4, worst
    print("ok", worst)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in ("export", "check") and len(sys.argv) == 3:
        (export if command == "export" else check)(pathlib.Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
