"""Tests of the embedded procedural compositional task, `flowgrpo_eqx.shapes_demo.task`."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from numpy.typing import NDArray

from flowgrpo_eqx.shapes_demo.task import (
    COLOURS,
    IMAGE_SIZE,
    NULL_TOKEN,
    PALETTE,
    SHAPES,
    VOCAB,
    VOCAB_SIZE,
    ShapesReward,
    ShapesTask,
)
from tests.errors import NAMED_ARGUMENT_ERRORS


TASK = ShapesTask()
RED, GREEN, BLUE, YELLOW = 0, 1, 2, 3
SQUARE, CIRCLE, TRIANGLE = 4, 5, 6
ATTRIBUTES = ("left_colour", "left_shape", "right_colour", "right_shape")

# Hand-picked, slightly off-palette colours, independent of the renderer's jitter.
HAND_RGB = {
    RED: (0.85, -0.9, -0.95),
    GREEN: (-0.95, 0.8, -0.85),
    BLUE: (-0.9, -0.95, 0.9),
    YELLOW: (0.9, 0.75, -0.9),
}


# --------------------------------------------------------------------------------------------
# An independent, deliberately simple drawing kit.


def blank(n: int = 1) -> NDArray[np.float64]:
    return np.full((n, IMAGE_SIZE, IMAGE_SIZE, 3), -1.0)


def shape_mask(shape: int, size: int) -> NDArray[np.bool_]:
    """A `size x size` mask of a square, a disc or an upward triangle."""
    yy, xx = np.mgrid[:size, :size]
    centre = (size - 1) / 2
    if shape == SQUARE:
        return np.ones((size, size), dtype=bool)
    if shape == CIRCLE:
        return bool_array((yy - centre) ** 2 + (xx - centre) ** 2 <= (size / 2 - 0.2) ** 2)
    if shape == TRIANGLE:
        half_width = np.floor(yy * (size // 2) / (size - 1) + 0.5)
        return bool_array(np.abs(xx - centre) <= half_width + 0.5)
    raise AssertionError(shape)


def bool_array(x: NDArray[np.bool_]) -> NDArray[np.bool_]:
    return np.asarray(x, dtype=bool)


def draw(
    image: NDArray[np.float64],
    shape: int,
    colour: int,
    top: int,
    left: int,
    size: int = 6,
) -> None:
    """Paint one object into an `[H, W, 3]` image in place."""
    mask = shape_mask(shape, size)
    patch = image[top : top + size, left : left + size]
    patch[mask] = HAND_RGB[colour]


def scene(
    tokens: tuple[int, int, int, int], left_pos: tuple[int, int] = (5, 1), size: int = 6
) -> NDArray[np.float64]:
    """A `[1, 16, 16, 3]` image of the prompt `tokens`, drawn by hand."""
    image = blank()
    cl, sl, cr, sr = tokens
    draw(image[0], sl, cl, left_pos[0], left_pos[1], size)
    draw(image[0], sr, cr, 4, 9, size)
    return image


def as_prompt(row: NDArray[np.integer]) -> tuple[int, int, int, int]:
    cl, sl, cr, sr = (int(v) for v in row)
    return cl, sl, cr, sr


def check_one(image: NDArray[np.float64], tokens: tuple[int, int, int, int]) -> dict[str, float]:
    result = TASK.check(image, np.array([tokens]))
    out = {name: float(getattr(result, name)[0]) for name in ATTRIBUTES}
    out["strict"] = float(result.strict[0])
    out["partial"] = float(result.partial[0])
    return out


# --------------------------------------------------------------------------------------------
# Vocabulary and prompts.


def test_vocabulary_constants() -> None:
    assert IMAGE_SIZE == 16
    assert VOCAB == ("red", "green", "blue", "yellow", "square", "circle", "triangle")
    assert COLOURS + SHAPES == VOCAB
    assert VOCAB_SIZE == 7
    assert NULL_TOKEN == VOCAB_SIZE
    assert PALETTE.shape == (4, 3)
    assert PALETTE.dtype == np.float32
    assert not PALETTE.flags.writeable


def test_caption() -> None:
    assert TASK.caption(np.array([RED, CIRCLE, BLUE, SQUARE])) == (
        "a red circle left of a blue square"
    )
    assert TASK.caption(np.array([YELLOW, TRIANGLE, GREEN, TRIANGLE])) == (
        "a yellow triangle left of a green triangle"
    )


def test_splits_are_disjoint_and_cover_all_prompts() -> None:
    train, heldout, all_ = (TASK.prompts(s) for s in ("train", "heldout", "all"))
    assert all_.tokens.shape == (144, 4)
    assert all_.tokens.dtype == np.int32
    as_set = {tuple(int(v) for v in row) for row in all_.tokens}
    assert len(as_set) == 144
    expected = set(itertools.product(range(4), range(4, 7), range(4), range(4, 7)))
    assert as_set == expected
    train_set = {tuple(row) for row in train.tokens.tolist()}
    heldout_set = {tuple(row) for row in heldout.tokens.tolist()}
    assert len(train_set) == len(train) == 108
    assert len(heldout_set) == len(heldout) == 36
    assert not train_set & heldout_set
    assert train_set | heldout_set == as_set
    # the documented rule
    for cl, sl, cr, sr in heldout_set:
        assert (cl + sl - 4 + cr + sr - 4) % 4 == 0
    for prompts in (train, heldout, all_):
        assert prompts.text == [TASK.caption(row) for row in prompts.tokens]


def test_splits_are_deterministic() -> None:
    for split in ("train", "heldout", "all"):
        np.testing.assert_array_equal(
            TASK.prompts(split).tokens, ShapesTask().prompts(split).tokens
        )


def test_every_vocab_item_and_object_appears_on_each_side_in_train() -> None:
    train = TASK.prompts("train").tokens
    for position in range(4):
        expected = set(range(4)) if position % 2 == 0 else set(range(4, 7))
        assert set(train[:, position].tolist()) == expected
    for side in (0, 1):
        objects = {tuple(row) for row in train[:, 2 * side : 2 * side + 2].tolist()}
        assert len(objects) == 12


def test_rows() -> None:
    for split in ("train", "heldout", "all"):
        rows = TASK.rows(split)
        assert set(rows) == {"tokens"}
        assert rows["tokens"].dtype == np.int32
        np.testing.assert_array_equal(rows["tokens"], TASK.prompts(split).tokens)


# --------------------------------------------------------------------------------------------
# The checker on hand-made images.


def test_handmade_images_of_every_prompt_pass() -> None:
    tokens = TASK.prompts("all").tokens
    for size in (5, 6, 7):
        images = np.concatenate([scene(as_prompt(row), size=size) for row in tokens])
        result = TASK.check(images, tokens)
        np.testing.assert_array_equal(result.strict, 1.0)
        np.testing.assert_array_equal(result.partial, 1.0)
        np.testing.assert_array_equal(result.predicted, tokens)


def test_handmade_pass_example() -> None:
    prompt = (RED, CIRCLE, BLUE, SQUARE)
    out = check_one(scene(prompt), prompt)
    assert out == {name: 1.0 for name in (*ATTRIBUTES, "strict", "partial")}


@pytest.mark.parametrize(
    ("drawn", "failing"),
    [
        ((GREEN, CIRCLE, BLUE, SQUARE), "left_colour"),
        ((YELLOW, CIRCLE, BLUE, SQUARE), "left_colour"),
        ((RED, SQUARE, BLUE, SQUARE), "left_shape"),
        ((RED, TRIANGLE, BLUE, SQUARE), "left_shape"),
        ((RED, CIRCLE, RED, SQUARE), "right_colour"),
        ((RED, CIRCLE, YELLOW, SQUARE), "right_colour"),
        ((RED, CIRCLE, BLUE, CIRCLE), "right_shape"),
        ((RED, CIRCLE, BLUE, TRIANGLE), "right_shape"),
    ],
)
def test_handmade_wrong_attribute_fails_only_that_attribute(
    drawn: tuple[int, int, int, int], failing: str
) -> None:
    prompt = (RED, CIRCLE, BLUE, SQUARE)
    out = check_one(scene(drawn), prompt)
    for name in ATTRIBUTES:
        assert out[name] == (0.0 if name == failing else 1.0), name
    assert out["strict"] == 0.0
    assert out["partial"] == 0.75


@pytest.mark.parametrize("side", [0, 1])
def test_handmade_missing_object_fails(side: int) -> None:
    prompt = (YELLOW, TRIANGLE, GREEN, CIRCLE)
    image = scene(prompt)
    image[0, :, 8 * side : 8 * side + 8] = -1.0
    out = check_one(image, prompt)
    names = ATTRIBUTES[2 * side : 2 * side + 2]
    for name in ATTRIBUTES:
        assert out[name] == (0.0 if name in names else 1.0), name
    assert out["partial"] == 0.5
    assert out["strict"] == 0.0


def test_empty_image_scores_zero() -> None:
    result = TASK.check(blank(3), TASK.prompts("all").tokens[:3])
    np.testing.assert_array_equal(result.partial, 0.0)
    np.testing.assert_array_equal(result.predicted, -1)


def test_handmade_swapped_sides_fail() -> None:
    prompt = (RED, CIRCLE, BLUE, SQUARE)
    out = check_one(scene((BLUE, SQUARE, RED, CIRCLE)), prompt)
    assert out["partial"] == 0.0
    assert out["strict"] == 0.0
    # swapping only the colours keeps the shapes right
    out = check_one(scene((BLUE, CIRCLE, RED, SQUARE)), prompt)
    assert (out["left_colour"], out["left_shape"]) == (0.0, 1.0)
    assert (out["right_colour"], out["right_shape"]) == (0.0, 1.0)


def test_handmade_two_colours_in_one_half_fail_colour() -> None:
    prompt = (RED, SQUARE, BLUE, SQUARE)
    image = scene(prompt)
    # left half: a 6x6 square that is half red, half green
    image[0, 5:11, 1:4] = HAND_RGB[RED]
    image[0, 5:11, 4:7] = HAND_RGB[GREEN]
    out = check_one(image, prompt)
    assert out["left_colour"] == 0.0
    assert out["left_shape"] == 1.0
    assert out["right_colour"] == out["right_shape"] == 1.0


def test_handmade_two_blobs_in_one_half_fail() -> None:
    prompt = (RED, SQUARE, BLUE, SQUARE)
    image = blank()
    draw(image[0], SQUARE, RED, 0, 1, 4)
    draw(image[0], SQUARE, GREEN, 10, 2, 5)
    draw(image[0], SQUARE, BLUE, 4, 9, 6)
    out = check_one(image, prompt)
    assert out["left_colour"] == 0.0
    assert out["left_shape"] == 0.0
    assert out["right_colour"] == out["right_shape"] == 1.0


def test_handmade_tiny_or_thin_object_fails_shape() -> None:
    prompt = (RED, SQUARE, BLUE, SQUARE)
    image = scene(prompt)
    image[0, :, :8] = -1.0
    image[0, 6:8, 2:4] = HAND_RGB[RED]  # 4 pixels: too few for anything
    out = check_one(image, prompt)
    assert out["left_colour"] == out["left_shape"] == 0.0
    image[0, :, :8] = -1.0
    image[0, 7, 0:7] = HAND_RGB[RED]  # a line: colour is clear, shape is not
    out = check_one(image, prompt)
    assert out["left_colour"] == 1.0
    assert out["left_shape"] == 0.0


def test_handmade_inverted_triangle_is_a_triangle() -> None:
    prompt = (GREEN, TRIANGLE, YELLOW, TRIANGLE)
    image = scene(prompt, size=7)
    image[0, :, :8] = image[0, ::-1, :8]
    assert check_one(image, prompt)["strict"] == 1.0


def test_out_of_range_and_nan_values_are_tolerated() -> None:
    prompt = (BLUE, TRIANGLE, RED, CIRCLE)
    image = scene(prompt) * 4.0  # far outside [-1, 1]; clipping restores it
    assert check_one(image, prompt)["strict"] == 1.0
    image[0, 0, 0] = np.nan
    image[0, 15, 15] = -np.inf
    assert check_one(image, prompt)["strict"] == 1.0


# --------------------------------------------------------------------------------------------
# The renderer.


def test_render_shape_dtype_range_and_background() -> None:
    tokens = TASK.prompts("all").tokens
    images = TASK.render(tokens, np.random.default_rng(0))
    assert images.shape == (144, IMAGE_SIZE, IMAGE_SIZE, 3)
    assert images.dtype == np.float32
    assert images.min() >= -1.0
    assert images.max() <= 1.0
    # the gutter between the halves is background, and so is most of the image
    np.testing.assert_array_equal(images[:, :, 7:9], -1.0)
    background = (images == -1.0).all(axis=-1).mean()
    assert 0.6 < background < 0.95


def test_render_object_sizes_and_sides() -> None:
    tokens = np.repeat(TASK.prompts("all").tokens, 10, axis=0)
    images = TASK.render(tokens, np.random.default_rng(1))
    foreground = images.max(axis=-1) > 0
    for half in (foreground[:, :, :8], foreground[:, :, 8:]):
        rows = half.any(axis=2).sum(axis=1)
        cols = half.any(axis=1).sum(axis=1)
        assert set(rows.tolist()) <= {5, 6, 7}
        assert set(cols.tolist()) <= {5, 6, 7}
        assert len(set(rows.tolist())) == 3  # the sizes vary


def test_render_is_reproducible_and_diverse() -> None:
    tokens = np.repeat(TASK.prompts("all").tokens[:1], 64, axis=0)
    a = TASK.render(tokens, np.random.default_rng(7))
    b = TASK.render(tokens, np.random.default_rng(7))
    c = TASK.render(tokens, np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    distinct = {image.tobytes() for image in a}
    assert len(distinct) == 64  # jittered position, size and colour


@pytest.mark.parametrize("seed", range(10))
def test_renders_pass_strict_check(seed: int) -> None:
    tokens = np.repeat(TASK.prompts("all").tokens, 8, axis=0)
    images = TASK.render(tokens, np.random.default_rng(seed))
    result = TASK.check(images, tokens)
    np.testing.assert_array_equal(result.strict, 1.0)
    np.testing.assert_array_equal(result.predicted, tokens)


def test_checker_discriminates_between_all_prompt_pairs() -> None:
    """A render of prompt p, checked against prompt q, scores the fraction of agreeing tokens."""
    tokens = TASK.prompts("all").tokens
    images = TASK.render(tokens, np.random.default_rng(3))
    p = np.repeat(np.arange(144), 144)
    q = np.tile(np.arange(144), 144)
    result = TASK.check(images[p], tokens[q])
    agreement = (tokens[p] == tokens[q]).mean(axis=1)
    np.testing.assert_array_equal(result.partial, agreement)
    np.testing.assert_array_equal(result.strict, (p == q).astype(np.float64))


def test_noisy_renders_mostly_pass() -> None:
    rng = np.random.default_rng(11)
    tokens = np.repeat(TASK.prompts("all").tokens, 10, axis=0)
    images = TASK.render(tokens, rng)
    noisy = images + rng.normal(0.0, 0.1, size=images.shape)
    assert TASK.check(noisy, tokens).strict.mean() >= 0.95


def test_mildly_blurred_renders_pass() -> None:
    """Soft edges, as a generative model would draw them, keep colours and shapes readable."""
    tokens = np.repeat(TASK.prompts("all").tokens, 5, axis=0)
    images = TASK.render(tokens, np.random.default_rng(12))
    kernel = np.array([0.2, 0.6, 0.2])
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-1.0)
    rows = sum(kernel[i] * padded[:, i : i + IMAGE_SIZE] for i in range(3))
    blurred = sum(kernel[j] * rows[:, :, j : j + IMAGE_SIZE] for j in range(3))
    assert not np.allclose(blurred, images)
    assert TASK.check(blurred, tokens).strict.mean() >= 0.95


# --------------------------------------------------------------------------------------------
# The reward.


def test_reward_partial_and_strict() -> None:
    prompt = (RED, CIRCLE, BLUE, SQUARE)
    images = np.concatenate(
        [
            scene(prompt),
            scene((RED, CIRCLE, BLUE, TRIANGLE)),
            scene((GREEN, SQUARE, BLUE, SQUARE)),
            blank(),
        ]
    )
    rows = {"tokens": np.array([prompt] * 4, dtype=np.int32)}
    partial = ShapesReward(TASK)(images, rows)
    strict = ShapesReward(TASK, "strict")(images, rows)
    assert partial.dtype == strict.dtype == np.float64
    assert partial.shape == strict.shape == (4,)
    np.testing.assert_array_equal(partial, [1.0, 0.75, 0.5, 0.0])
    np.testing.assert_array_equal(strict, [1.0, 0.0, 0.0, 0.0])
    assert ShapesReward(TASK).name == "shapes_partial"
    assert ShapesReward(TASK, kind="strict").name == "shapes_strict"


@pytest.mark.parametrize("rows", [None, np.zeros((1, 4), np.int32)], ids=["none", "array"])
def test_reward_rows_that_are_not_a_dict_are_named(rows: object) -> None:
    """Rows sent as None or a bare array raised "argument of type 'NoneType' is not
    iterable" or an ambiguous truth value (the fault probe, through the reward server)."""
    reward = ShapesReward(TASK)
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="rows"):
        reward(blank(), rows)
    # As a reward server calls it, without this suite's runtime type checker in front.
    unchecked = getattr(ShapesReward.__call__, "__wrapped__", ShapesReward.__call__)
    with pytest.raises(ValueError, match="^`rows` must be a dict holding 'tokens', got"):
        unchecked(reward, blank(), rows)


def test_reward_accepts_jax_arrays() -> None:
    tokens = TASK.rows("heldout")["tokens"]
    images = TASK.render(tokens, np.random.default_rng(5))
    reward = ShapesReward(TASK, "strict")
    out = reward(jnp.asarray(images), {"tokens": jnp.asarray(tokens)})
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, 1.0)


@pytest.mark.parametrize("kind", ["partial", "strict"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reward_refuses_non_finite_samples_naming_the_rows(kind: str, bad: float) -> None:
    from flowgrpo_eqx import RewardError

    images = np.concatenate([blank(), blank(), blank()])
    images[2, 5, 5, 1] = bad  # the checker alone would read NaN as background
    tokens = np.array([(RED, CIRCLE, BLUE, SQUARE)] * 3, dtype=np.int32)
    reward = ShapesReward(TASK, kind)  # type: ignore[arg-type]
    with pytest.raises(RewardError, match=r"shapes_.* non-finite `samples` .* at rows \[2\]"):
        reward(images, {"tokens": tokens})


# --------------------------------------------------------------------------------------------
# Bad inputs.


def test_bad_split_raises() -> None:
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="split"):
        TASK.prompts("test")  # type: ignore[arg-type]
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="split"):
        TASK.rows("validation")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([[RED, CIRCLE, BLUE]]),  # wrong length
        np.array([RED, CIRCLE, BLUE, SQUARE]),  # unbatched
        np.array([[4, CIRCLE, BLUE, SQUARE]]),  # a shape id where a colour goes
        np.array([[RED, RED, BLUE, SQUARE]]),  # a colour id where a shape goes
        np.array([[RED, CIRCLE, BLUE, NULL_TOKEN]]),  # the null token is no word
        np.array([[-1, CIRCLE, BLUE, SQUARE]]),
        np.array([[0.0, 5.0, 2.0, 4.0]]),  # not integers
    ],
)
def test_bad_tokens_raise(tokens: NDArray[np.generic]) -> None:
    with pytest.raises(ValueError, match="tokens"):
        TASK.render(tokens, np.random.default_rng(0))
    with pytest.raises(ValueError, match="tokens"):
        TASK.check(blank(1), tokens)
    with pytest.raises(ValueError, match="tokens"):
        ShapesReward(TASK)(blank(1), {"tokens": tokens})


def test_bad_caption_tokens_raise() -> None:
    with pytest.raises(ValueError, match="tokens"):
        TASK.caption(np.array([[RED, CIRCLE, BLUE, SQUARE]]))
    with pytest.raises(ValueError, match="tokens"):
        TASK.caption(np.array([RED, CIRCLE, BLUE, 9]))


@pytest.mark.parametrize(
    "shape", [(16, 16, 3), (1, 16, 16), (1, 16, 16, 4), (1, 8, 8, 3), (1, 3, 16, 16)]
)
def test_bad_image_shape_raises(shape: tuple[int, ...]) -> None:
    tokens = np.array([[RED, CIRCLE, BLUE, SQUARE]])
    with pytest.raises(ValueError, match="images"):
        TASK.check(np.zeros(shape), tokens)
    with pytest.raises(ValueError, match="samples"):
        ShapesReward(TASK)(np.zeros(shape), {"tokens": tokens})


def test_batch_mismatch_and_missing_rows_raise() -> None:
    tokens = np.array([[RED, CIRCLE, BLUE, SQUARE]] * 2)
    with pytest.raises(ValueError, match="batch size"):
        TASK.check(blank(3), tokens)
    with pytest.raises(ValueError, match="rows"):
        ShapesReward(TASK)(blank(2), {"prompt_ids": tokens})


def test_bad_reward_kind_and_task_settings_raise() -> None:
    with pytest.raises(NAMED_ARGUMENT_ERRORS, match="kind"):
        ShapesReward(TASK, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_pixels"):
        ShapesTask(min_pixels=0)
    with pytest.raises(ValueError, match="min_dominance"):
        ShapesTask(min_dominance=1.5)
    with pytest.raises(ValueError, match="foreground_threshold"):
        ShapesTask(foreground_threshold=1.0)
