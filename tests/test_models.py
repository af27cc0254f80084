"""Tests of the small velocity networks in `flowgrpo_eqx.models`.

Inputs are made with NumPy and passed straight into jitted calls: eager `jax.random` / `jnp` ops
compile once per shape, which would dominate the run time on a small CPU.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowgrpo_eqx.models import DiT, MLPVelocity, silu, sinusoidal_time_features
from tests.tiny_models import perturbed
from tests.tolerances import activation_tolerance


KEY = jax.random.key(0)


@eqx.filter_jit
def _vcall(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    """The model on a batch: `vmap` over rows, as the library calls it."""
    out: jax.Array = jax.vmap(model)(x, t, cond)
    return out


@eqx.filter_jit
def _call(model: Any, x: Any, t: Any, cond: Any) -> jax.Array:
    """The model on one unbatched example."""
    out: jax.Array = model(x, t, cond)
    return out


def _num_params(model: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _small_dit() -> DiT:
    return DiT(image_size=8, channels=3, patch=2, width=32, depth=2, heads=4, key=KEY)


def _dit_inputs(model: DiT, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n, model.image_size, model.image_size, model.channels)
    x = rng.standard_normal(shape).astype(np.float32)
    t = rng.uniform(size=(n,)).astype(np.float32)
    cond = rng.integers(0, model.vocab_size, size=(n, model.prompt_length)).astype(np.int32)
    return x, t, cond


def _scalar(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


# ---------------------------------------------------------------- sinusoidal time features


def test_time_features_shape_and_distinct() -> None:
    features = jax.jit(lambda t: sinusoidal_time_features(t, 16))
    a = features(_scalar(0.3))
    b = features(_scalar(0.31))
    assert a.shape == (16,)
    assert a.dtype == jnp.float32
    a_np = np.asarray(a)
    assert np.all(np.abs(a_np) <= 1.0)
    assert not np.allclose(a_np, np.asarray(b))
    # cos^2 + sin^2 = 1 for each frequency.
    np.testing.assert_allclose(a_np[:8] ** 2 + a_np[8:] ** 2, 1.0, rtol=1e-5)


def test_time_features_bad_size() -> None:
    with pytest.raises(ValueError, match="num_features"):
        sinusoidal_time_features(jnp.array(0.3), 7)
    with pytest.raises(ValueError, match="num_features"):
        sinusoidal_time_features(jnp.array(0.3), 0)


def test_silu_value_and_derivative_match_numpy() -> None:
    x = np.concatenate([np.linspace(-40.0, 40.0, 4001), [0.0, -1e-6, 1e-6]]).astype(np.float32)
    value_and_slope = jax.jit(jax.vmap(jax.value_and_grad(silu)))
    value, slope = (np.asarray(a, np.float64) for a in value_and_slope(x))
    x64 = x.astype(np.float64)
    sigmoid = 1.0 / (1.0 + np.exp(-x64))
    # relative to max(1, |x|): in the far negative tail `1 + tanh(x / 2)` rounds to 0 on a CPU
    # where the exact value is below 2e-6 in magnitude
    scale = np.maximum(1.0, np.abs(x64))
    tolerance = activation_tolerance()
    assert np.all(np.abs(value - x64 * sigmoid) <= tolerance * scale)
    assert np.all(np.abs(slope - sigmoid * (1.0 + x64 * (1.0 - sigmoid))) <= tolerance * scale)


# ---------------------------------------------------------------- MLPVelocity


def test_mlp_shape_dtype_vmap_jit() -> None:
    model = MLPVelocity(latent_dim=6, cond_dim=3, hidden=32, depth=3, key=KEY)
    x = _normal(1, (5, 6))
    t = np.linspace(0.0, 1.0, 5, dtype=np.float32)
    cond = _normal(2, (5, 3))
    out = _vcall(model, x, t, cond)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert np.all(np.isfinite(np.asarray(out)))
    # The unbatched call agrees with the batched one.
    single = _call(model, x[2], t[2], cond[2])
    np.testing.assert_allclose(np.asarray(single), np.asarray(out[2]), rtol=1e-5, atol=1e-6)
    # Low-precision inputs come back in their own dtype (compute is in the float32 params).
    out_bf16 = _vcall(model, x.astype(jnp.bfloat16), t.astype(jnp.bfloat16), cond)
    assert out_bf16.dtype == jnp.bfloat16
    assert out_bf16.shape == x.shape


def test_mlp_structure_and_param_count() -> None:
    model = MLPVelocity(latent_dim=64, cond_dim=16, key=KEY)
    assert len(model.layers) == 4
    assert model.layers[0].weight.shape == (512, 64 + 64 + 16)
    assert all(layer.weight.shape == (512, 512) for layer in model.layers[1:])
    assert model.out.weight.shape == (64, 512)
    # The hidden x hidden matmuls dominate the FLOPs.
    hidden_macs = 3 * 512 * 512
    other_macs = (64 + 64 + 16) * 512 + 512 * 64
    assert hidden_macs > 5 * other_macs
    assert _num_params(model) == (144 * 512 + 512) + 3 * (512 * 512 + 512) + (512 * 64 + 64)
    # Equinox's default Linear init: U(-1/sqrt(in), 1/sqrt(in)), roughly uniform-looking.
    weight = np.asarray(model.layers[1].weight)
    limit = 1 / np.sqrt(512)
    assert np.abs(weight).max() <= limit
    np.testing.assert_allclose(weight.std(), limit / np.sqrt(3), rtol=0.02)
    # Different keys give different parameters.
    other = MLPVelocity(latent_dim=64, cond_dim=16, key=jax.random.key(1))
    assert not np.allclose(weight, np.asarray(other.layers[1].weight))


def test_mlp_depends_on_t_and_cond() -> None:
    model = MLPVelocity(latent_dim=4, cond_dim=2, hidden=32, depth=2, key=KEY)
    x = np.ones(4, dtype=np.float32)
    cond = np.array([0.5, -0.5], dtype=np.float32)
    base = np.asarray(_call(model, x, _scalar(0.2), cond))
    assert not np.allclose(base, np.asarray(_call(model, x, _scalar(0.7), cond)))
    for i in range(2):
        other = cond.copy()
        other[i] += 1.0
        assert not np.allclose(base, np.asarray(_call(model, x, _scalar(0.2), other)))


def test_mlp_unconditional() -> None:
    model = MLPVelocity(latent_dim=3, cond_dim=0, hidden=8, depth=1, key=KEY)
    out = _call(model, np.ones(3, np.float32), _scalar(0.5), np.zeros(0, np.float32))
    assert out.shape == (3,)
    assert np.all(np.isfinite(np.asarray(out)))


def test_mlp_sgd_reduces_loss() -> None:
    model = MLPVelocity(latent_dim=4, cond_dim=2, hidden=64, depth=2, key=KEY)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    t = rng.uniform(size=(64,)).astype(np.float32)
    cond = rng.standard_normal((64, 2)).astype(np.float32)
    target = np.tanh(x[:, ::-1]) * (1.0 + t[:, None]) + cond[:, :1]

    @eqx.filter_jit
    def step(m: MLPVelocity, x: Any, t: Any, cond: Any, target: Any) -> Any:
        def loss_fn(m: MLPVelocity) -> jax.Array:
            return jnp.mean((jax.vmap(m)(x, t, cond) - target) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(m)
        return loss, eqx.apply_updates(m, jax.tree.map(lambda g: -0.1 * g, grads))

    losses = []
    for _ in range(100):
        loss, model = step(model, x, t, cond, target)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.25 * losses[0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(latent_dim=0, cond_dim=2), "latent_dim"),
        (dict(latent_dim=4, cond_dim=-1), "cond_dim"),
        (dict(latent_dim=4, cond_dim=2, hidden=0), "hidden"),
        (dict(latent_dim=4, cond_dim=2, depth=0), "depth"),
        (dict(latent_dim=4, cond_dim=2, time_features=7), "time_features"),
    ],
)
def test_mlp_bad_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        MLPVelocity(**kwargs, key=KEY)


def test_mlp_wrong_shapes_raise() -> None:
    model = MLPVelocity(latent_dim=4, cond_dim=2, hidden=8, depth=1, key=KEY)
    with pytest.raises(ValueError, match="`x`"):
        _call(model, np.ones(5, np.float32), _scalar(0.5), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="`cond`"):
        _call(model, np.ones(4, np.float32), _scalar(0.5), np.zeros(3, np.float32))


# ---------------------------------------------------------------- DiT


def test_dit_defaults_shape_dtype() -> None:
    model = DiT(key=KEY)
    assert 100_000 <= _num_params(model) <= 400_000
    assert model.pos_embed.shape == (64, 64)
    x, t, cond = _dit_inputs(model, 3, 1)
    assert x.shape == (3, 16, 16, 3)
    # Shapes and dtypes by abstract evaluation (the small model below is run for real).
    out = eqx.filter_eval_shape(_vcall, model, x, t, cond)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    out = eqx.filter_eval_shape(_vcall, model, x.astype(jnp.bfloat16), t, cond)
    assert out.dtype == jnp.bfloat16
    # The adaLN-Zero parts start at zero.
    assert np.all(np.asarray(model.final_proj.weight) == 0.0)
    assert all(np.all(np.asarray(block.modulation.weight) == 0.0) for block in model.blocks)


def test_dit_zero_init_then_nonzero_and_vmap_consistent() -> None:
    model = _small_dit()
    x, t, cond = _dit_inputs(model, 4, 1)
    out = _vcall(model, x, t, cond)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    # adaLN-Zero: the initial velocity is exactly zero.
    assert np.all(np.asarray(out) == 0.0)
    # After perturbing the parameters it is not.
    model = perturbed(model, seed=1)
    out = _vcall(model, x, t, cond)
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.abs(np.asarray(out)).max() > 1e-3
    # The unbatched call agrees with the batched one.
    single = _call(model, x[1], t[1], cond[1])
    np.testing.assert_allclose(np.asarray(single), np.asarray(out[1]), rtol=1e-4, atol=1e-5)


def test_dit_depends_on_t_and_every_token() -> None:
    model = perturbed(_small_dit(), seed=1)
    x = _normal(2, (8, 8, 3))
    cond = np.array([0, 1, 2, 3], dtype=np.int32)
    t = _scalar(0.4)
    base = np.asarray(_call(model, x, t, cond))
    assert not np.allclose(base, np.asarray(_call(model, x, _scalar(0.8), cond)), atol=1e-6)
    for i in range(4):
        changed = cond.copy()
        changed[i] = 5
        out = np.asarray(_call(model, x, t, changed))
        assert not np.allclose(base, out, atol=1e-6), f"output ignores prompt token {i}"
        if i < 2:
            # The left half of the image responds to the left object's tokens.
            assert not np.allclose(base[:, :4], out[:, :4], atol=1e-6)
    # In-context conditioning alone (pooled prompt vector cut off) still reaches every token.
    no_pool = eqx.tree_at(
        lambda m: (m.cond_mlp[1].weight, m.cond_mlp[1].bias),
        model,
        replace_fn=lambda a: jax.device_put(np.zeros(a.shape, np.float32)),
    )
    base_ic = np.asarray(_call(no_pool, x, t, cond))
    for i in range(4):
        changed = cond.copy()
        changed[i] = 5
        out = np.asarray(_call(no_pool, x, t, changed))
        assert not np.allclose(base_ic, out, atol=1e-6), f"in-context path ignores token {i}"
    # The null token (vocab_size - 1) is an ordinary embedding row.
    null = np.full((4,), model.vocab_size - 1, dtype=np.int32)
    out = np.asarray(_call(model, x, t, null))
    assert np.all(np.isfinite(out))
    assert not np.allclose(base, out, atol=1e-6)


def test_dit_gradients_finite_and_start_nonzero() -> None:
    model = _small_dit()
    x, t, cond = _dit_inputs(model, 4, 1)
    target = _normal(2, x.shape)

    @eqx.filter_jit
    def grad_fn(m: DiT, x: Any, t: Any, cond: Any, target: Any) -> Any:
        def loss_fn(m: DiT) -> jax.Array:
            return jnp.mean((jax.vmap(m)(x, t, cond) - target) ** 2)

        return eqx.filter_grad(loss_fn)(m)

    # At the zero init the final projection gets a nonzero gradient (training can start).
    grads = grad_fn(model, x, t, cond, target)
    assert np.abs(np.asarray(grads.final_proj.weight)).max() > 0.0
    assert np.abs(np.asarray(grads.final_proj.bias)).max() > 0.0
    # Away from init every gradient is finite, and the deep parameters get one too.
    grads = grad_fn(perturbed(model, seed=3), x, t, cond, target)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    assert np.abs(np.asarray(grads.token_embed)).max() > 0.0
    assert np.abs(np.asarray(grads.prompt_pos_embed)).max() > 0.0
    assert np.abs(np.asarray(grads.blocks[0].qkv.weight)).max() > 0.0
    assert np.abs(np.asarray(grads.pos_embed)).max() > 0.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(image_size=9, patch=2), "patch"),
        (dict(width=30, heads=4), "heads"),
        (dict(image_size=0), "image_size"),
        (dict(channels=0), "channels"),
        (dict(patch=0), "patch"),
        (dict(width=-8), "width"),
        (dict(depth=0), "depth"),
        (dict(heads=0), "heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(prompt_length=0), "prompt_length"),
    ],
)
def test_dit_bad_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DiT(**kwargs, key=KEY)


def test_dit_wrong_shapes_raise() -> None:
    model = _small_dit()
    cond = np.zeros(4, dtype=np.int32)
    with pytest.raises(ValueError, match="`x`"):
        _call(model, np.ones((8, 8, 4), np.float32), _scalar(0.5), cond)
    with pytest.raises(ValueError, match="`x`"):
        _call(model, np.ones((16, 16, 3), np.float32), _scalar(0.5), cond)
    with pytest.raises(ValueError, match="`cond`"):
        _call(model, np.ones((8, 8, 3), np.float32), _scalar(0.5), np.zeros(5, np.int32))
