"""`MMDiT` against diffusers' `SD3Transformer2DModel`, and the diffusers time grid, without torch.

The fixtures under `tests/data/` were made by diffusers itself (`tools/make_sd3_fixtures.py
make`, run by hand with torch and diffusers): tiny random SD3 and SD3.5 transformers in the
diffusers format with inputs and diffusers' outputs, the key layout of the full-size
SD3.5-Medium (built on torch's 'meta' device), and the scheduler's sigmas.
"""

import functools
import json
import pathlib
import shutil
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import flowgrpo_eqx as fg
from flowgrpo_eqx import lora
from flowgrpo_eqx.models import MMDiT, load_diffusers, save_diffusers, save_diffusers_lora
from tests.diffusers_helpers import (
    WEIGHTS,
    assert_exported_lora_merges,
    assert_layout_is,
    assert_saved_folder_matches,
    count,
    random_lora,
    relative,
    vcall,
)
from tests.errors import NAMED_ARGUMENT_ERRORS
from tests.tolerances import reference_model_rtol


DATA = pathlib.Path(__file__).resolve().parent / "data"
TINY = ["sd3_tiny", "sd35_tiny"]


@functools.cache
def _model(name: str, dtype: Any = None) -> MMDiT:
    return load_diffusers(DATA / name, context_length=5, dtype=dtype)


def _io(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(DATA / name / "io.npz"))


def _velocity(model: Any, io: dict[str, np.ndarray]) -> np.ndarray:
    cond = {"context": io["context"], "pooled": io["pooled"]}
    return np.asarray(vcall(model, io["x"], io["t"], cond), np.float32)


@pytest.mark.parametrize("name", TINY)
def test_load_diffusers_matches_diffusers(name: str) -> None:
    model = _model(name)
    io = _io(name)
    assert model.pos_embed.value.dtype == jnp.float32
    assert relative(_velocity(model, io), io["v"]) < reference_model_rtol()
    if name == "sd35_tiny":
        assert model.qk_norm == "rms_norm" and model.dual_attention_layers == (0,)
        assert model.blocks[0].attn2 is not None and model.blocks[1].attn2 is None


@pytest.mark.parametrize("name", TINY)
def test_position_table_is_diffusers_buffer(name: str) -> None:
    buffer = load_file(DATA / name / WEIGHTS)["pos_embed.pos_embed"][0]
    np.testing.assert_allclose(_model(name).position_table(full=True), buffer, atol=1e-6)


@pytest.mark.parametrize("name", TINY)
def test_save_diffusers_round_trip(name: str, tmp_path: pathlib.Path) -> None:
    model = _model(name)
    save_diffusers(tmp_path, model)
    assert_saved_folder_matches(DATA / name, tmp_path)
    again = load_diffusers(tmp_path, context_length=5)
    io = _io(name)
    assert relative(_velocity(again, io), _velocity(model, io)) < 1e-5


def _copy(name: str, tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    return folder


def test_unused_keys_are_listed(tmp_path: pathlib.Path) -> None:
    folder = _copy("sd35_tiny", tmp_path)
    tensors = load_file(folder / WEIGHTS)
    tensors["transformer_blocks.9.attn.to_q.weight"] = np.zeros((16, 16), np.float32)
    tensors["extra.bias"] = np.zeros((3,), np.float32)
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="2 keys map to no leaf") as error:
        load_diffusers(folder, context_length=5)
    assert "transformer_blocks.9.attn.to_q.weight" in str(error.value)
    assert "extra.bias" in str(error.value)


def test_missing_keys_list_the_unfilled_leaves(tmp_path: pathlib.Path) -> None:
    folder = _copy("sd35_tiny", tmp_path)
    tensors = load_file(folder / WEIGHTS)
    del tensors["transformer_blocks.0.attn2.norm_k.weight"], tensors["proj_out.bias"]
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match="2 leaves have no key") as error:
        load_diffusers(folder, context_length=5)
    message = str(error.value)
    assert ".blocks[0].attn2.norm_k (key transformer_blocks.0.attn2.norm_k.weight)" in message
    assert ".final_proj.bias (key proj_out.bias)" in message


def test_wrong_shape_and_config_are_named(tmp_path: pathlib.Path) -> None:
    folder = _copy("sd3_tiny", tmp_path)
    tensors = load_file(folder / WEIGHTS)
    tensors["proj_out.bias"] = np.zeros((3,), np.float32)
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(ValueError, match=r"proj_out.bias has shape \(3,\)"):
        load_diffusers(folder, context_length=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "out_channels": 8}))
    with pytest.raises(ValueError, match="`out_channels`"):
        load_diffusers(folder, context_length=5)
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "FluxTransformer"}))
    with pytest.raises(ValueError, match="FluxTransformer"):
        load_diffusers(folder, context_length=5)
    with pytest.raises(ValueError, match="neither"):
        (folder / WEIGHTS).unlink()
        (folder / "config.json").write_text(json.dumps(config))
        load_diffusers(folder, context_length=5)


def test_sharded_checkpoint(tmp_path: pathlib.Path) -> None:
    folder = _copy("sd3_tiny", tmp_path)
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    keys = sorted(tensors)
    shards = {"part-1.safetensors": keys[::2], "part-2.safetensors": keys[1::2]}
    weight_map = {}
    for shard, names in shards.items():
        save_file({k: tensors[k] for k in names}, folder / shard)
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / f"{WEIGHTS}.index.json").write_text(json.dumps(index))
    sharded = load_diffusers(folder, context_length=5)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(_model("sd3_tiny")), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16(tmp_path: pathlib.Path) -> None:
    name = "sd35_tiny"
    half = _model(name, jnp.bfloat16)
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(eqx.filter(half, eqx.is_inexact_array))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    io = _io(name)
    assert relative(_velocity(half, io), io["v"]) < 0.1
    # A bfloat16 checkpoint (safetensors' NumPy reader has no bfloat16) loads in bfloat16.
    save_diffusers(tmp_path, half)
    with safe_open(str(tmp_path / WEIGHTS), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    again = load_diffusers(tmp_path, context_length=5)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(half), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_sd35_medium_from_its_config_alone() -> None:
    record = json.loads((DATA / "sd35_medium_keys.json").read_text())
    config = {**MMDiT.sd35_medium_config(), "stacked": False}
    model = eqx.filter_eval_shape(lambda key: MMDiT(**config, key=key), jax.random.key(0))
    grid_table = 64 * 64 * 1536
    assert record["parameters"] == 2_243_171_520
    assert count(model) - grid_table == record["parameters"]
    # Every key of the published layout maps to a leaf with diffusers' shape, and back.
    assert_layout_is(model, record["keys"])
    sd3 = eqx.filter_eval_shape(
        lambda key: MMDiT(**MMDiT.sd3_medium_config(), key=key), jax.random.key(0)
    )
    assert count(sd3) - grid_table == record["sd3_medium_parameters"] == 2_028_328_000
    # Stacked (the default) holds the same arrays in three groups.
    stacked = eqx.filter_eval_shape(
        lambda key: MMDiT(**MMDiT.sd35_medium_config(), key=key), jax.random.key(0)
    )
    assert stacked.stacked and count(stacked) == count(model)


@pytest.mark.parametrize("name", TINY)
def test_stacked_and_unstacked_loads_compute_the_same(name: str, tmp_path: pathlib.Path) -> None:
    stacked = _model(name)
    plain = load_diffusers(DATA / name, context_length=5, stacked=False)
    assert stacked.stacked and not plain.stacked and len(plain.blocks) == plain.depth
    io = _io(name)
    np.testing.assert_allclose(_velocity(stacked, io), _velocity(plain, io), rtol=0, atol=1e-6)
    # Both write the same file.
    save_diffusers(tmp_path / "stacked", stacked)
    save_diffusers(tmp_path / "plain", plain)
    one, other = load_file(tmp_path / "stacked" / WEIGHTS), load_file(tmp_path / "plain" / WEIGHTS)
    assert one.keys() == other.keys()
    for key in one:
        np.testing.assert_array_equal(one[key], other[key], err_msg=key)


def test_lora_adapters_export(tmp_path: pathlib.Path) -> None:
    model = _model("sd35_tiny")
    policy = random_lora(model)
    # The patch convolution's adapters too: `lora_A` `[r, C, p, p]`, `lora_B` `[out, r, 1, 1]`.
    modules = assert_exported_lora_merges(policy, DATA / "sd35_tiny" / WEIGHTS, tmp_path)
    assert len(modules) == len(policy.layer_paths)
    assert "pos_embed.proj" in modules and "transformer_blocks.0.attn2.to_q" in modules
    with pytest.raises(ValueError, match="LoraModel"):
        save_diffusers_lora(tmp_path / "x", model)  # type: ignore[arg-type]


def test_models_without_a_diffusers_counterpart_are_refused(tmp_path: pathlib.Path) -> None:
    tokens = MMDiT(image_size=8, depth=1, width=16, heads=2, vocab_size=5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="token-id"):
        save_diffusers(tmp_path, tokens)


def test_diffusers_grid_is_the_schedulers_sigmas() -> None:
    record = json.loads((DATA / "flow_match_sigmas.json").read_text())
    flow = fg.RectifiedFlow(shift=record["shift"], grid=fg.DiffusersGrid())
    for steps, sigmas in record["sigmas"].items():
        grid = np.asarray(flow.timesteps(int(steps) + 1))
        assert grid.dtype == np.float32 and grid[0] == 1.0 and grid[-1] == 0.0
        np.testing.assert_allclose(grid, sigmas, rtol=0, atol=1e-6)
    want = [1, 0.96013, 0.91335, 0.85769, 0.79037, 0.70728, 0.60215, 0.46488, 0.27805, 0.00893, 0]
    np.testing.assert_allclose(np.asarray(flow.timesteps(11)), want, atol=5e-6)
    assert fg.RectifiedFlow(shift=3.0).grid == fg.UniformGrid()
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="`?grid`?"):
        fg.RectifiedFlow(grid="diffusers")  # type: ignore[arg-type]


def test_without_a_position_table_size(tmp_path: pathlib.Path) -> None:
    # diffusers keeps the position buffer out of the checkpoint then, and computes it for the
    # image's grid with `base_size = sample_size // patch`; so do we.
    model = MMDiT(image_size=8, depth=2, width=16, heads=2, sample_size=4, key=jax.random.key(0))
    save_diffusers(tmp_path, model)
    assert "pos_embed.pos_embed" not in load_file(tmp_path / WEIGHTS)
    assert json.loads((tmp_path / "config.json").read_text())["pos_embed_max_size"] is None
    again = load_diffusers(tmp_path, image_size=8, context_length=model.context_length)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Positions step by `base / side` = 2 / 4 along each axis.
    table = model.position_table()
    np.testing.assert_allclose(table[1, :2], [np.sin(0.5), np.sin(0.5 / 10_000**0.25)], rtol=1e-6)


def test_lora_export_of_stacked_blocks_is_one_adapter_per_block(tmp_path: pathlib.Path) -> None:
    sizes = dict(image_size=4, channels=4, depth=4, width=16, heads=2, context_length=3)
    sizes.update(context_dim=8, pooled_dim=8, dual_attention_layers=(0, 1))
    stacked = MMDiT(**sizes, key=jax.random.key(0))
    assert [jax.tree.leaves(group)[0].shape[0] for group in stacked.blocks] == [2, 1, 1]
    policy = lora.add(stacked, 2, key=jax.random.key(1), where=lambda m: m.blocks[0].image.attn.q)
    assert policy.adapters[0].a.shape == (2, 2, 16) and policy.adapters[0].b.shape == (2, 16, 2)
    rng = np.random.default_rng(2)
    b = jnp.asarray(rng.standard_normal((2, 16, 2)), jnp.float32)
    policy = eqx.tree_at(lambda p: p.adapters[0].b, policy, b)
    save_diffusers_lora(tmp_path, policy)
    saved = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    assert sorted(saved) == [
        f"transformer.transformer_blocks.{i}.attn.to_q.lora_{m}.weight"
        for i in (0, 1)
        for m in ("A", "B")
    ]
    for i in (0, 1):
        block = f"transformer.transformer_blocks.{i}.attn.to_q"
        np.testing.assert_array_equal(saved[f"{block}.lora_A.weight"], policy.adapters[0].a[i])
        np.testing.assert_array_equal(saved[f"{block}.lora_B.weight"], np.asarray(b[i]))
