"""What `flowgrpo-eqx finetune` exports at the end of a run is what diffusers loads, and
diffusers computes with it what our policy computes.

`tools/make_export_fixtures.py` (run by hand: `export` with JAX, `check` with torch, diffusers
0.42.1 and peft 0.22) built, for each tiny pipeline of `tests/data/pipelines/`, the policy a
run starts from (a finetune configuration read from TOML, the kind's transformer loader and
`make_policy`: rank 2 on the kind's default targets), gave every adapter a `b` drawn from a
fixed key, wrote it with `export_policy`, and had diffusers load both exports: the merged
transformer with `from_pretrained`, the adapters onto the base pipeline with
`pipe.load_lora_weights`. The two agreed to 3.8e-7 and our velocity to 2.5e-6 (of the largest
`|v|`); the adapters moved diffusers' output by 0.3 to 0.7 of it. `<name>_export.npz` holds
the inputs, diffusers' two outputs (`v_transformer`, `v_lora`), the LoRA keys diffusers holds
after loading (every key of the file, each with the file's values), what diffusers logged
while loading, and the digests of the exported tensors.

Here, without torch, the same policy is rebuilt and exported, and: its files hold the very
tensors diffusers loaded (the digests), diffusers took every LoRA key we write and no other,
and our velocity of the policy and of the exported transformer read back with the kind's
loader are diffusers' outputs.
"""

import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from flowgrpo_eqx.finetune._export import export_policy
from flowgrpo_eqx.models import load_diffusers
from tests.diffusers_helpers import relative
from tests.tolerances import reference_model_rtol
from tools import make_export_fixtures as fixtures


pytest.importorskip("tokenizers", reason="the finetune configuration names a reward processor")


@pytest.fixture(scope="module", params=fixtures.NAMES)
def exported(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """One pipeline's policy, built and exported as the fixture script did, in a temporary
    folder, with the fixture."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    settings = fixtures.config(name, folder)
    policy = fixtures.policy(name, settings)
    written = export_policy(policy, folder / "out", dtype="float32")
    assert written == [folder / "out" / "lora", folder / "out" / "transformer"]
    record = dict(np.load(fixtures.PIPELINES / f"{name}_export.npz"))
    return {
        "name": name,
        "settings": settings,
        "policy": policy,
        "out": folder / "out",
        "record": record,
    }


def test_the_exported_tensors_are_those_diffusers_loaded(exported: dict[str, Any]) -> None:
    out, record = exported["out"], exported["record"]
    assert fixtures.tensors_digest(out / "lora") == str(record["digest_lora"])
    assert fixtures.tensors_digest(out / "transformer") == str(record["digest_transformer"])


def test_diffusers_took_every_lora_key_we_write(exported: dict[str, Any]) -> None:
    record = exported["record"]
    written = load_file(exported["out"] / "lora" / "pytorch_lora_weights.safetensors")
    assert sorted(written) == [str(key) for key in record["lora_keys"]]
    # Each adapted layer's pair, under the diffusers module name of one of the kind's targets.
    targets = exported["settings"].lora.targets
    for key in written:
        module = re.fullmatch(r"transformer\.(.+)\.lora_[AB]\.weight", key)
        assert module is not None and module[1].endswith(tuple(f".{t}" for t in targets)), key
    # diffusers said nothing while loading but that the file has no text encoder's keys.
    for message in record["load_warnings"]:
        assert re.match(r"diffusers\.loaders\.lora_base: No LoRA keys associated to", message)


def test_our_velocity_is_diffusers(exported: dict[str, Any]) -> None:
    name, record = exported["name"], exported["record"]
    values = {
        key: record[key] for key in ("x", "t", "context", "pooled", "guidance") if key in record
    }
    for key, value in fixtures.inputs(name).items():
        np.testing.assert_array_equal(values[key], value)
    # Read back as finetune reads a transformer, at the fixture's latent and text sizes.
    size = values["x"].shape[1:-1]
    merged = load_diffusers(
        exported["out"] / "transformer",
        image_size=size[0] if name == "sd35" else size,
        context_length=values["context"].shape[1],
        dtype=jnp.float32,
    )
    tolerance = reference_model_rtol()
    for model in (exported["policy"], merged):
        v = fixtures.velocity(model, values)
        for reference in ("v_transformer", "v_lora"):
            assert relative(v, record[reference]) < tolerance, (name, reference)
