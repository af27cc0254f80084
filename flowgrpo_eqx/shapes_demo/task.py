"""A procedural, laptop-scale stand-in for GenEval: two coloured shapes, one per image half.

Every prompt composes four attributes, "a `<colour>` `<shape>` left of a `<colour>` `<shape>`",
over a palette of 4 colours and 3 shapes: 4 * 3 * 4 * 3 = 144 prompts. A prompt is the token
array `[colour_left, shape_left, colour_right, shape_right]` of ids into the joint vocabulary
`VOCAB = COLOURS + SHAPES` (colour ids `0..3`, shape ids `4..6`).

Images are `IMAGE_SIZE x IMAGE_SIZE` RGB, float32 in `[-1, 1]`, laid out `[H, W, 3]` (batches
`[N, H, W, 3]`), on a black (`-1`) background. The left object lies in columns `0..7`, the right
one in columns `8..15`.

`ShapesTask.render` draws ground-truth images; `ShapesTask.check` is a rule-based checker in the
spirit of GenEval's object checks; `ShapesReward` wraps the checker as a reward function.
Everything is host-side numpy; nothing is downloaded.
"""

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt
from numpy.typing import NDArray

from .. import check_finite_samples


SPLITS: Final[tuple[str, ...]] = ("train", "heldout", "all")
"""The split names: the training split, the held-out split, or all 144 prompts."""

REWARD_KINDS: Final[tuple[str, ...]] = ("partial", "strict")
"""The scores `ShapesReward` can return."""

Split: TypeAlias = Literal["train", "heldout", "all"]
"""A split of the prompts."""

RewardKind: TypeAlias = Literal["partial", "strict"]
"""Which score of the checker a `ShapesReward` returns."""

IMAGE_SIZE: Final = 16
"""Height and width of every image, in pixels."""

HALF: Final = IMAGE_SIZE // 2
"""Width of each half; the left object is in columns `[0, HALF)`, the right in `[HALF, 16)`."""

COLOURS: Final[tuple[str, ...]] = ("red", "green", "blue", "yellow")
"""Colour words; colour `i` has token id `i`."""

SHAPES: Final[tuple[str, ...]] = ("square", "circle", "triangle")
"""Shape words; shape `j` has token id `len(COLOURS) + j`."""

VOCAB: Final[tuple[str, ...]] = COLOURS + SHAPES
"""The joint vocabulary: token id `i` is the word `VOCAB[i]`."""

VOCAB_SIZE: Final = len(VOCAB)
"""Number of real tokens (7)."""

NULL_TOKEN: Final = VOCAB_SIZE
"""The null-condition token id (7), for classifier-free guidance; not a word of `VOCAB`."""

NUM_COLOURS: Final = len(COLOURS)
NUM_SHAPES: Final = len(SHAPES)
PROMPT_LENGTH: Final = 4
"""Tokens per prompt: `[colour_left, shape_left, colour_right, shape_right]`."""

NUM_PROMPTS: Final = (NUM_COLOURS * NUM_SHAPES) ** 2
"""Number of distinct prompts (144)."""


def _palette() -> NDArray[np.float32]:
    palette = np.array(
        [[1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0], [1.0, 1.0, -1.0]],
        dtype=np.float32,
    )
    palette.setflags(write=False)
    return palette


PALETTE: Final[NDArray[np.float32]] = _palette()
"""`[4, 3]` read-only: colour `i`'s pure RGB value in `[-1, 1]` (red, green, blue, yellow)."""

OBJECT_SIZES: Final[tuple[int, ...]] = (5, 6, 7)
"""Side lengths (pixels) of the square bounding box of a rendered object."""

_MAX_SIZE: Final = max(OBJECT_SIZES)

# Shape-classifier thresholds, on the foreground mask of one half (see `ShapesTask.check`).
_MIN_SIDE: Final = 3  # bounding box at least 3 x 3
_MIN_ASPECT: Final = 0.6  # bounding box width / height within [0.6, 1 / 0.6]
_TRIANGLE_ASYMMETRY: Final = 0.1  # |mass fraction in one bbox half - 0.5| at least this
_TRIANGLE_FILL: Final = (0.35, 0.8)
_SQUARE_FILL: Final = 0.92  # symmetric with fill >= this: square
_CIRCLE_FILL: Final = 0.55  # symmetric with fill in [this, _SQUARE_FILL): circle


def _templates() -> NDArray[np.bool_]:
    """`[NUM_SHAPES, len(OBJECT_SIZES), 7, 7]` masks, each object in the top-left corner."""
    out = np.zeros((NUM_SHAPES, len(OBJECT_SIZES), _MAX_SIZE, _MAX_SIZE), dtype=np.bool_)
    for k, s in enumerate(OBJECT_SIZES):
        y, x = np.mgrid[:s, :s].astype(np.float64)
        c = (s - 1) / 2
        out[0, k, :s, :s] = True
        out[1, k, :s, :s] = (y - c) ** 2 + (x - c) ** 2 <= 0.9 * (s / 2) ** 2
        # apex up: row y spans a width growing linearly to the full base on the last row
        out[2, k, :s, :s] = np.abs(x - c) <= (s / 2) * (y + 1) / s
    out.setflags(write=False)
    return out


_TEMPLATES: Final[NDArray[np.bool_]] = _templates()


@final
@dataclasses.dataclass(frozen=True, eq=False)
class Prompts:
    """A set of prompts, as tokens and as text.

    **Arguments:**

    - `tokens`: `[P, 4]` int32, each row `[colour_left, shape_left, colour_right, shape_right]`.
    - `text`: the `P` captions, `text[i] == caption(tokens[i])`.
    """

    tokens: NDArray[np.int32]
    text: list[str]

    def __len__(self) -> int:
        return len(self.text)


@final
@dataclasses.dataclass(frozen=True, eq=False)
class CheckResult:
    """What `ShapesTask.check` found, per image.

    **Arguments:**

    - `strict`: `[N]` float64, 1.0 where all four attributes hold, else 0.0.
    - `partial`: `[N]` float64, the fraction of the four attributes that hold.
    - `left_colour`, `left_shape`, `right_colour`, `right_shape`: `[N]` bool, each attribute.
    - `predicted`: `[N, 4]` int64, the tokens the checker read off each image in prompt order,
        `-1` where an attribute could not be determined.
    """

    strict: NDArray[np.float64]
    partial: NDArray[np.float64]
    left_colour: NDArray[np.bool_]
    left_shape: NDArray[np.bool_]
    right_colour: NDArray[np.bool_]
    right_shape: NDArray[np.bool_]
    predicted: NDArray[np.int64]


def _check_tokens(tokens: npt.ArrayLike, name: str, batched: bool) -> NDArray[np.int64]:
    arr = np.asarray(tokens)
    expected = "[N, 4]" if batched else "[4]"
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"`{name}` must hold integer token ids, got dtype {arr.dtype}.")
    shape_ok = (
        arr.ndim == 2 and arr.shape[1] == PROMPT_LENGTH
        if batched
        else arr.shape == (PROMPT_LENGTH,)
    )
    if not shape_ok:
        raise ValueError(f"`{name}` must have shape {expected}, got {arr.shape}.")
    arr = arr.astype(np.int64).reshape(-1, PROMPT_LENGTH)
    colours = arr[:, 0::2]
    shapes = arr[:, 1::2]
    if colours.size and (colours.min() < 0 or colours.max() >= NUM_COLOURS):
        raise ValueError(
            f"`{name}` colour entries (positions 0 and 2) must be in [0, {NUM_COLOURS}), got "
            f"values in [{colours.min()}, {colours.max()}]."
        )
    if shapes.size and (shapes.min() < NUM_COLOURS or shapes.max() >= VOCAB_SIZE):
        raise ValueError(
            f"`{name}` shape entries (positions 1 and 3) must be in [{NUM_COLOURS}, "
            f"{VOCAB_SIZE}), got values in [{shapes.min()}, {shapes.max()}]."
        )
    return arr


def _check_images(images: npt.ArrayLike, name: str) -> NDArray[np.float32]:
    arr = np.asarray(images)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise ValueError(f"`{name}` must be a real-valued array, got dtype {arr.dtype}.")
    if arr.ndim != 4 or arr.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(
            f"`{name}` must have shape [N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {arr.shape}."
        )
    out = arr.astype(np.float32)
    return np.clip(np.where(np.isnan(out), np.float32(-1.0), out), -1.0, 1.0)


def _heldout_mask(tokens: NDArray[np.int64]) -> NDArray[np.bool_]:
    shape_index = tokens[:, 1::2] - NUM_COLOURS
    total = tokens[:, 0] + shape_index[:, 0] + tokens[:, 2] + shape_index[:, 1]
    held: NDArray[np.bool_] = total % 4 == 0
    return held


def _all_tokens() -> NDArray[np.int64]:
    rows = itertools.product(
        range(NUM_COLOURS),
        range(NUM_COLOURS, VOCAB_SIZE),
        range(NUM_COLOURS),
        range(NUM_COLOURS, VOCAB_SIZE),
    )
    return np.array(list(rows), dtype=np.int64)


NUM_TRAIN_PROMPTS: Final = int(np.sum(~_heldout_mask(_all_tokens())))
"""How many prompts the training split has (108)."""


@final
@dataclasses.dataclass(frozen=True)
class ShapesTask:
    """The two-object compositional task: prompts, a renderer and a rule-based checker.

    **Splits.** A prompt `[cl, sl, cr, sr]` is held out when
    `(cl + (sl - 4) + cr + (sr - 4)) % 4 == 0`: exactly 36 of the 144 prompts (1/4). Every
    (colour, shape) object, hence every colour and every shape, still appears on both sides in
    the 108 training prompts (9 of each object's 12 partners are in train), and every held-out
    prompt is a new combination of objects seen in training. Prompts are listed in lexicographic
    token order.

    **Arguments:**

    - `min_pixels`: the fewest foreground pixels a half needs to hold an object.
    - `min_dominance`: the least fraction of a half's foreground pixels that must be nearest the
        detected colour.
    - `foreground_threshold`: a pixel is foreground when its largest channel exceeds this (in
        `[-1, 1]`; the background is `-1`, object colours have a channel near `1`).

    **Raises:**

    - `ValueError`: naming the argument, if `min_pixels < 1`, `min_dominance` is not in
        `(0, 1]`, or `foreground_threshold` is not in `(-1, 1)`.
    """

    min_pixels: int = 6
    min_dominance: float = 0.6
    foreground_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.min_pixels < 1:
            raise ValueError(f"`min_pixels` must be >= 1, got {self.min_pixels}.")
        if not 0.0 < self.min_dominance <= 1.0:
            raise ValueError(f"`min_dominance` must be in (0, 1], got {self.min_dominance}.")
        if not -1.0 < self.foreground_threshold < 1.0:
            raise ValueError(
                f"`foreground_threshold` must be in (-1, 1), got {self.foreground_threshold}."
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The shape of one image, `(16, 16, 3)`."""
        return (IMAGE_SIZE, IMAGE_SIZE, 3)

    def prompts(self, split: Split) -> Prompts:
        """The prompts of one split.

        **Arguments:**

        - `split`: `"train"` (108 prompts), `"heldout"` (36) or `"all"` (144).

        **Returns:**

        A `Prompts` with `[P, 4]` int32 tokens in lexicographic order, and their captions.

        **Raises:**

        - `ValueError`: if `split` is not one of the three names.
        """
        tokens = _all_tokens()
        if split == "all":
            keep = np.ones(len(tokens), dtype=np.bool_)
        elif split == "heldout":
            keep = _heldout_mask(tokens)
        elif split == "train":
            keep = ~_heldout_mask(tokens)
        else:
            raise ValueError(f"`split` must be 'train', 'heldout' or 'all', got {split!r}.")
        chosen = tokens[keep]
        return Prompts(tokens=chosen.astype(np.int32), text=[_caption(row) for row in chosen])

    def rows(self, split: Split) -> dict[str, NDArray[np.int32]]:
        """The conditioning rows of one split, as the rollout and models take them.

        **Arguments:**

        - `split`: as for `prompts`.

        **Returns:**

        `{"tokens": tokens}` with `tokens` the `[P, 4]` int32 array of `prompts(split)`.

        **Raises:**

        - `ValueError`: if `split` is not one of `"train"`, `"heldout"`, `"all"`.
        """
        return {"tokens": self.prompts(split).tokens}

    def caption(self, tokens: npt.ArrayLike) -> str:
        """The text of one prompt, e.g. `"a red circle left of a blue square"`.

        **Arguments:**

        - `tokens`: `[4]` integer token ids.

        **Returns:**

        The caption.

        **Raises:**

        - `ValueError`: naming `tokens`, on a wrong shape or dtype or an out-of-range id.
        """
        return _caption(_check_tokens(tokens, "tokens", batched=False)[0])

    def render(self, tokens: npt.ArrayLike, rng: np.random.Generator) -> NDArray[np.float32]:
        """Draw ground-truth images that satisfy the prompts, with random variation.

        Each object is drawn in its half with a random side length from `OBJECT_SIZES`
        (5-7 px), a random position that keeps it off the central column pair (so a one-pixel
        gutter separates the halves) and a random per-object colour jitter (full channels in
        `[0.6, 1]`, empty ones in `[-1, -0.8]`). Circles are digital discs, triangles point up.

        **Arguments:**

        - `tokens`: `[N, 4]` integer token ids.
        - `rng`: the numpy generator to draw the variation from.

        **Returns:**

        `[N, 16, 16, 3]` float32 images in `[-1, 1]`.

        **Raises:**

        - `ValueError`: naming `tokens`, on a wrong shape or dtype or an out-of-range id.
        """
        toks = _check_tokens(tokens, "tokens", batched=True)
        n = int(toks.shape[0])
        image = np.full((n, IMAGE_SIZE, IMAGE_SIZE, 3), -1.0, dtype=np.float32)
        yy = np.arange(IMAGE_SIZE)[None, :, None]
        xx = np.arange(IMAGE_SIZE)[None, None, :]
        sizes = np.asarray(OBJECT_SIZES)
        for side in (0, 1):
            colour: NDArray[np.int64] = toks[:, 2 * side]
            shape: NDArray[np.int64] = toks[:, 2 * side + 1] - NUM_COLOURS
            size_index = rng.integers(0, len(OBJECT_SIZES), size=n)
            size = sizes[size_index]
            # starting column range, inclusive: left [0, 7 - s], right [9, 16 - s]
            x_lo = 0 if side == 0 else HALF + 1
            x_hi = HALF - 1 - size if side == 0 else IMAGE_SIZE - size
            x0 = x_lo + rng.integers(0, x_hi - x_lo + 1, size=n)
            y0 = rng.integers(0, IMAGE_SIZE - size + 1, size=n)
            ry = yy - y0[:, None, None]
            rx = xx - x0[:, None, None]
            inside = (ry >= 0) & (ry < _MAX_SIZE) & (rx >= 0) & (rx < _MAX_SIZE)
            template = (shape * len(OBJECT_SIZES) + size_index)[:, None, None]
            flat = (template * _MAX_SIZE + np.clip(ry, 0, _MAX_SIZE - 1)) * _MAX_SIZE + np.clip(
                rx, 0, _MAX_SIZE - 1
            )
            mask = inside & _TEMPLATES.reshape(-1)[flat]
            high = rng.uniform(0.6, 1.0, size=(n, 3))
            low = rng.uniform(-1.0, -0.8, size=(n, 3))
            rgb = np.where(PALETTE[colour] > 0, high, low).astype(np.float32)
            image = np.where(mask[..., None], rgb[:, None, None, :], image)
        return image

    def check(self, images: npt.ArrayLike, tokens: npt.ArrayLike) -> CheckResult:
        """Check each image against its prompt, attribute by attribute.

        Values are first clipped to `[-1, 1]` (NaN counts as background). Each half
        (columns `0..7`, `8..15`) is judged on its own:

        - *Foreground*: pixels whose largest channel exceeds `foreground_threshold`.
        - *Colour*: the palette colour nearest the mean foreground colour. It counts only if the
            half has at least `min_pixels` foreground pixels and at least `min_dominance` of
            them are individually nearest to that colour (so an empty half, or two blobs of
            different colours, fails).
        - *Shape*: from the foreground mask's bounding box (at least 3 x 3, aspect within
            `[0.6, 1/0.6]`), its fill ratio (foreground / box area) and its asymmetry (how far
            the foreground mass in the box's top half, or left half, is from 1/2). Asymmetry
            >= 0.1 with fill in `[0.35, 0.8]` is a triangle (any orientation); otherwise fill
            >= 0.92 is a square and fill in `[0.55, 0.92)` a circle; anything else is no shape.

        **Arguments:**

        - `images`: `[N, 16, 16, 3]` real images, nominally in `[-1, 1]`.
        - `tokens`: `[N, 4]` integer token ids, the prompts.

        **Returns:**

        A `CheckResult` with `strict` and `partial` scores and per-attribute booleans.

        **Raises:**

        - `ValueError`: naming `images` or `tokens`, on a wrong shape or dtype, an
            out-of-range token id, or when their batch sizes differ.
        """
        imgs = _check_images(images, "images")
        toks = _check_tokens(tokens, "tokens", batched=True)
        if imgs.shape[0] != toks.shape[0]:
            raise ValueError(
                f"`images` and `tokens` must have the same batch size, got {imgs.shape[0]} "
                f"and {toks.shape[0]}."
            )
        left_colour, left_shape = self._read_half(imgs[:, :, :HALF])
        right_colour, right_shape = self._read_half(imgs[:, :, HALF:])
        predicted = np.stack([left_colour, left_shape, right_colour, right_shape], axis=1)
        hits = predicted == toks
        partial = hits.mean(axis=1, dtype=np.float64)
        strict = hits.all(axis=1).astype(np.float64)
        return CheckResult(
            strict=strict,
            partial=partial,
            left_colour=hits[:, 0],
            left_shape=hits[:, 1],
            right_colour=hits[:, 2],
            right_shape=hits[:, 3],
            predicted=predicted.astype(np.int64),
        )

    def _read_half(self, half: NDArray[np.float32]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Colour token and shape token read off `[N, H, W, 3]` halves; `-1` where none."""
        n, height, width, _ = half.shape
        fg = half.max(axis=-1) > self.foreground_threshold
        count = fg.sum(axis=(1, 2))
        enough = count >= self.min_pixels
        safe_count = np.maximum(count, 1).astype(np.float64)

        # colour: all palette colours have the same norm, so the nearest one is the one with the
        # largest dot product
        palette = PALETTE.T.astype(half.dtype)
        nearest = (half @ palette).argmax(axis=-1)
        mean_rgb = (half * fg[..., None]).sum(axis=(1, 2)) / safe_count[:, None]
        colour = (mean_rgb @ palette).argmax(axis=-1)
        agree = (fg & (nearest == colour[:, None, None])).sum(axis=(1, 2))
        colour_ok = enough & (agree >= self.min_dominance * safe_count)
        colour_id = np.where(colour_ok, colour, -1)

        # shape
        row_count = fg.sum(axis=2)
        col_count = fg.sum(axis=1)
        row_any = row_count > 0
        col_any = col_count > 0
        r0 = row_any.argmax(axis=1)
        r1 = height - row_any[:, ::-1].argmax(axis=1)
        c0 = col_any.argmax(axis=1)
        c1 = width - col_any[:, ::-1].argmax(axis=1)
        h = (r1 - r0).astype(np.float64)
        w = (c1 - c0).astype(np.float64)
        fill = count / np.maximum(h * w, 1.0)
        aspect = w / np.maximum(h, 1.0)
        # fraction of each row (column) lying above (left of) the bounding box's midline
        top_weight = np.clip((r0 + r1)[:, None] / 2 - np.arange(height)[None, :], 0.0, 1.0)
        left_weight = np.clip((c0 + c1)[:, None] / 2 - np.arange(width)[None, :], 0.0, 1.0)
        top_frac = (row_count * top_weight).sum(axis=1) / safe_count
        left_frac = (col_count * left_weight).sum(axis=1) / safe_count
        asymmetry = np.maximum(np.abs(top_frac - 0.5), np.abs(left_frac - 0.5))
        valid = (
            enough
            & (h >= _MIN_SIDE)
            & (w >= _MIN_SIDE)
            & (aspect >= _MIN_ASPECT)
            & (aspect <= 1.0 / _MIN_ASPECT)
        )
        triangular = asymmetry >= _TRIANGLE_ASYMMETRY
        triangle = valid & triangular & (fill >= _TRIANGLE_FILL[0]) & (fill <= _TRIANGLE_FILL[1])
        square = valid & ~triangular & (fill >= _SQUARE_FILL)
        circle = valid & ~triangular & (fill >= _CIRCLE_FILL) & (fill < _SQUARE_FILL)
        shape_id = np.full(n, -1, dtype=np.int64)
        shape_id[square] = NUM_COLOURS + 0
        shape_id[circle] = NUM_COLOURS + 1
        shape_id[triangle] = NUM_COLOURS + 2
        return colour_id.astype(np.int64), shape_id


def _caption(row: NDArray[np.int64]) -> str:
    cl, sl, cr, sr = (int(v) for v in row)
    return f"a {VOCAB[cl]} {VOCAB[sl]} left of a {VOCAB[cr]} {VOCAB[sr]}"


@final
@dataclasses.dataclass(frozen=True)
class ShapesReward:
    """The checker as a reward: `reward(samples, rows) -> [N]` float64 scores.

    **Arguments:**

    - `task`: the `ShapesTask` whose checker scores the samples.
    - `kind`: `"partial"` (fraction of the four attributes satisfied) or `"strict"` (1.0 only
        when all four hold).

    **Raises:**

    - `ValueError`: naming `kind`, if it is neither `"partial"` nor `"strict"`.
    """

    task: ShapesTask
    kind: RewardKind = "partial"

    def __post_init__(self) -> None:
        if self.kind not in REWARD_KINDS:
            raise ValueError(f"`kind` must be 'partial' or 'strict', got {self.kind!r}.")

    @property
    def name(self) -> str:
        """`"shapes_partial"` or `"shapes_strict"`."""
        return f"shapes_{self.kind}"

    def __call__(self, samples: npt.ArrayLike, rows: Mapping[str, Any]) -> NDArray[np.float64]:
        """Score samples against the prompts they were generated for.

        **Arguments:**

        - `samples`: `[N, 16, 16, 3]` images in `[-1, 1]` (numpy or JAX; values outside are
            clipped).
        - `rows`: the conditioning rows; `rows["tokens"]` is `[N, 4]` integer token ids.

        **Returns:**

        `[N]` float64 scores in `[0, 1]`.

        **Raises:**

        - `ValueError`: naming `samples` on a wrong shape or dtype, `rows` if it lacks
            `"tokens"`, or `tokens` as in `ShapesTask.check`.
        - `RewardError`: naming the rows, if samples hold NaN or inf (the checker alone
            would read NaN as background).
        """
        array = np.asarray(samples)
        check_finite_samples(self.name, array)
        images = _check_images(array, "samples")
        if not isinstance(rows, Mapping):
            raise ValueError(f"`rows` must be a dict holding 'tokens', got {type(rows).__name__}.")
        if "tokens" not in rows:
            raise ValueError(f"`rows` must contain 'tokens', got keys {sorted(rows)}.")
        result = self.task.check(images, np.asarray(rows["tokens"]))
        return result.partial if self.kind == "partial" else result.strict
