"""`tools.tpu.norm_variants`: the query-key RMSNorm computed on the heads split apart,
swapped into a model for the library's, computes the same velocity (the library's against a
float64 statement: `tests/test_head_rms_norm.py`); and the variant experiments' shared
command line names a bad argument."""

import jax
import numpy as np
import pytest

from flowgrpo_eqx.models import MMDiT, _joint
from flowgrpo_eqx.models._layers import rms_norm
from tests.tiny_models import SD35_SHAPED, batch_of_two, perturbed
from tools.tpu import norm_variants
from tools.tpu.norm_variants import joint_attention_norm


def test_swapped_into_a_model_it_computes_the_same_velocity_and_is_put_back():
    model = perturbed(MMDiT(**SD35_SHAPED, key=jax.random.key(0)))
    x, t, cond = batch_of_two(2)

    def velocity() -> np.ndarray:
        return np.asarray(jax.jit(jax.vmap(model))(x, t, cond))

    library = velocity()
    assert np.abs(library).max() > 1e-2
    with joint_attention_norm(rms_norm):
        assert _joint.head_rms_norm is rms_norm
        swapped = velocity()
    assert _joint.head_rms_norm is not rms_norm
    np.testing.assert_allclose(swapped, library, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("main", [norm_variants.main])
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--calls", "0"], "--calls"),
        (["--row", "sd35m b3"], "--row"),
        (["--variants", "library,nonsense"], "--variants"),
        (["--variants", ","], "--variants"),
    ],
)
def test_the_experiments_name_a_bad_argument_before_measuring(main, argv, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_the_benchs_model_flops_do_not_count_the_norms_reduction_products(precision):
    """The block-diagonal 0/1 products compute a per-head mean, not the architecture's
    matmuls: the model's FLOPs are the same with the norm split into heads (no products),
    at the default matmul precision and at the one the suite sets on a TPU."""
    from bench import _full_size

    (row,) = _full_size.rows("sd35m b8 splash nothing")
    with jax.default_matmul_precision(precision):
        library = _full_size.model_flops(row)
        with joint_attention_norm(rms_norm):
            split = _full_size.model_flops(row)
    assert library == split
    assert 58.5e12 < library < 58.7e12
