"""`T5Encoder` against transformers' `T5EncoderModel`, without torch.

The fixtures under `tests/data/t5/` were made by transformers itself
(`tools/make_t5_fixtures.py`, run by hand with torch and transformers).
"""

import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import T5Encoder, load_t5
from flowgrpo_eqx.models._mirror import state_dict_leaves
from tests.diffusers_helpers import count, relative
from tests.tolerances import reference_model_rtol


T5 = pathlib.Path(__file__).resolve().parent / "data" / "t5"


@pytest.mark.parametrize("name", ["v1_1", "relu"])
def test_the_encoder_matches_transformers(name: str) -> None:
    rtol = reference_model_rtol()
    model = load_t5(T5 / name)
    io = dict(np.load(T5 / name / "io.npz"))
    last = np.asarray(jax.vmap(model)(jnp.asarray(io["ids"])))
    assert relative(last, io["last"]) < rtol
    masked = np.asarray(jax.vmap(model)(jnp.asarray(io["ids"]), jnp.asarray(io["mask"])))
    assert relative(masked, io["last_masked"]) < rtol


def test_the_relative_position_buckets_are_t5s() -> None:
    from flowgrpo_eqx.models._t5 import relative_position_buckets

    # A float64 statement of Mesh TensorFlow's bidirectional bucketing, 32 buckets, 128 far.
    def bucket(relative: int) -> int:
        half, exact = 16, 8
        out = half if relative > 0 else 0
        distance = abs(relative)
        if distance < exact:
            return out + distance
        large = exact + int(np.log(distance / exact) / np.log(128 / exact) * (half - exact))
        return out + min(large, half - 1)

    got = relative_position_buckets(300, 32, 128)
    want = np.array([[bucket(k - q) for k in range(300)] for q in range(300)])
    np.testing.assert_array_equal(got, want)


def test_t5_v1_1_xxl_has_transformers_parameter_count_and_keys() -> None:
    record = json.loads((T5 / "t5_keys.json").read_text())
    model = eqx.filter_eval_shape(
        lambda key: T5Encoder(**T5Encoder.v1_1_xxl_config(), key=key), jax.random.key(0)
    )
    assert count(model) == record["parameters"] == 4_762_310_656
    ours = {key: list(leaf.shape) for key, leaf in state_dict_leaves(model).items()}
    theirs = {k: v for k, v in record["keys"].items() if k != "encoder.embed_tokens.weight"}
    assert ours == theirs


def test_a_feed_forward_the_module_does_not_compute_is_refused_by_its_field(
    tmp_path: pathlib.Path,
) -> None:
    folder = tmp_path / "t5"
    shutil.copytree(T5 / "v1_1", folder)
    config = json.loads((folder / "config.json").read_text())
    config["feed_forward_proj"] = "gated-silu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="`feed_forward_proj`"):
        load_t5(folder)
