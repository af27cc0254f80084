"""`load_diffusers` takes the configuration fields diffusers' transformer classes take, not only
the published values, and refuses, by the field's name, only what our models cannot compute.

The fixtures under `tests/data/fields/` were made by diffusers itself
(`tools/make_field_fixtures.py`, run by hand with torch and diffusers): one tiny random model of
each class with fields away from the published ones, and diffusers' velocity for fixed inputs.
"""

import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest

from flowgrpo_eqx.models import Flux, MMDiT, Wan, load_diffusers, save_diffusers
from tests.diffusers_helpers import relative, vcall
from tests.tolerances import reference_model_rtol


FIELDS = pathlib.Path(__file__).resolve().parent / "data" / "fields"


def _io(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIELDS / name / "io.npz"))


def _cond(name: str, io: dict[str, np.ndarray]) -> Any:
    if name == "wan":
        return io["context"]
    return {"context": io["context"], "pooled": io["pooled"]}


def _load(folder: pathlib.Path, name: str, **kwargs: Any) -> Any:
    sizes = {"wan": (2, 4, 6), "flux": (4, 6), "sd3": None}
    return load_diffusers(folder, image_size=sizes[name], context_length=5, **kwargs)


def _velocity(model: Any, name: str, io: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(vcall(model, io["x"], io["t"], _cond(name, io)), np.float32)


@pytest.mark.parametrize("name", ["wan", "flux", "sd3"])
def test_a_model_with_fields_off_the_published_values_computes_diffusers_velocity(
    name: str, tmp_path: pathlib.Path
) -> None:
    io = _io(name)
    model = _load(FIELDS / name, name)
    assert relative(_velocity(model, name, io), io["v"]) < reference_model_rtol()
    save_diffusers(tmp_path, model)
    again = _load(tmp_path, name, stacked=False)
    np.testing.assert_allclose(
        _velocity(again, name, io), _velocity(model, name, io), rtol=1e-6, atol=1e-5
    )


def test_the_wan_fields_are_read() -> None:
    model = _load(FIELDS / "wan", "wan")
    assert isinstance(model, Wan)
    assert (model.freq_dim, model.eps, model.cross_attn_norm) == (32, 1e-5, False)
    assert model.time_mlp[0].in_features == 32


def test_the_flux_and_sd3_fields_are_read() -> None:
    flux = _load(FIELDS / "flux", "flux")
    assert isinstance(flux, Flux)
    assert (flux.channels, flux.guidance_embeds, flux.axes_dims) == (3, False, (4, 4, 4))
    mmdit = _load(FIELDS / "sd3", "sd3")
    assert isinstance(mmdit, MMDiT)
    assert (mmdit.patch, mmdit.heads, mmdit.pos_embed_max_size) == (1, 3, 10)
    assert (mmdit.qk_norm, mmdit.dual_attention_layers) == ("rms_norm", (1,))


@pytest.mark.parametrize(
    ("name", "field", "value", "words"),
    [
        ("wan", "image_dim", 1280, "image conditioning"),
        ("wan", "added_kv_proj_dim", 64, "image conditioning"),
        ("wan", "pos_embed_seq_len", 514, "image conditioning"),
        ("wan", "out_channels", 8, "the velocity has the latent's shape"),
        ("wan", "rope_max_seq_len", 2, "rotary table"),
        ("flux", "out_channels", 12, "`in_channels` (12)"),
        ("sd3", "caption_projection_dim", 16, "attention width"),
        ("sd3", "qk_norm", "layer_norm", "qk_norm"),
    ],
)
def test_what_our_models_cannot_compute_is_refused_by_the_fields_name(
    name: str, field: str, value: Any, words: str, tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / name
    shutil.copytree(FIELDS / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"`{field}`") as error:
        _load(folder, name)
    assert words in str(error.value)
