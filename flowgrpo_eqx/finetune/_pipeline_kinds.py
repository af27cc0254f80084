"""How each model kind's pipeline folder is read (`PIPELINE_KINDS`): the transformer, the
VAE and the text side from the folder, or random weights of the published size
(`random_model`), with the latent shape, time grid and guidance the pipeline computes; one
class per kind (`SD3Kind`, `FluxKind`, `WanKind`) on `AbstractPipelineKind`."""

import abc
import functools
import html
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import (
    CFG,
    AbstractAutoEncoder,
    AbstractGuidance,
    DiffusersGrid,
    EmbeddedGuidance,
    FluxGrid,
    RectifiedFlow,
    flux_shift,
)
from ..models import (
    AutoencoderKL,
    AutoencoderKLWan,
    Flux,
    FluxPromptEncoder,
    MMDiT,
    PromptTokenizer,
    SD3PromptEncoder,
    Wan,
    WanPromptEncoder,
    load_clip,
    load_diffusers,
    load_t5,
)
from ._config import FinetuneConfig
from ._kinds import ModelKind, PipelineError, read_json
from ._text_side import Rows, TextSide, jit_encoder, numpy_rows, random_rows


def _dtype(config: FinetuneConfig) -> Any:
    return jnp.bfloat16 if config.pipeline.dtype == "bfloat16" else jnp.float32


class AbstractPipelineKind(abc.ABC):
    """How one model kind's pipeline is read and what it gives the trainer."""

    pipeline_class: ClassVar[str]
    subfolders: ClassVar[tuple[str, ...]]

    @abc.abstractmethod
    def latent_shape(
        self, config: FinetuneConfig, folder: pathlib.Path | None = None
    ) -> tuple[int, ...]:
        """The latent of one sample at the configured size: as the pipeline computes it from
        its VAE's `config.json` in `folder`, or the published VAE's (`None`).

        **Raises:**

        - `PipelineError`: naming the setting, for a size the VAE or the patches cannot take.
        """

    @abc.abstractmethod
    def transformer(self, folder: pathlib.Path | None, config: FinetuneConfig) -> Any:
        """The transformer from `folder/transformer`, or random of the published size."""

    @abc.abstractmethod
    def vae(self, folder: pathlib.Path | None, config: FinetuneConfig) -> AbstractAutoEncoder:
        """The VAE from `folder/vae`, or random of the published size."""

    @abc.abstractmethod
    def text(self, folder: pathlib.Path | None, config: FinetuneConfig, model: Any) -> TextSide:
        """The text side from the folder's encoders and tokenizers, or stand-in embeddings of
        the model's condition for random weights."""

    @abc.abstractmethod
    def process(self, folder: pathlib.Path | None, config: FinetuneConfig) -> RectifiedFlow:
        """The time grid of the pipeline's scheduler."""

    @abc.abstractmethod
    def guidance(self, config: FinetuneConfig) -> AbstractGuidance | None:
        """The guidance at the configured scale."""

    select: ClassVar[tuple[str, ...] | str]
    needs_null: ClassVar[bool]

    def check_folder(self, folder: pathlib.Path) -> None:
        """Refuse a pipeline folder that lacks a subfolder the kind reads.

        **Raises:**

        - `PipelineError`: naming the missing subfolder.
        """
        for name in self.subfolders:
            if not (folder / name).is_dir():
                raise PipelineError(
                    f"{folder} has no {name}/ folder: a {self.pipeline_class} folder holds "
                    f"{', '.join(f'{n}/' for n in self.subfolders)}."
                )

    def scheduler_shift(self, folder: pathlib.Path | None, default: float) -> float:
        """The scheduler's `shift` (or `flow_shift`), from `scheduler/scheduler_config.json`."""
        if folder is None or not (folder / "scheduler").is_dir():
            return default
        config = read_json(folder / "scheduler" / "scheduler_config.json", "the scheduler")
        value = config.get("flow_shift", config.get("shift", default))
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise PipelineError(
                f"{folder / 'scheduler' / 'scheduler_config.json'} gives the shift {value!r}; a "
                "positive number was expected."
            )
        return float(value)


def _side(config: FinetuneConfig, name: str, factor: int) -> int:
    """An image side in latent pixels for a VAE that downsamples by `factor`, refused unless
    `2 factor` divides it (the transformer's patches are 2 latent pixels wide)."""
    height, width = config.image_size()
    value = height if name == "height" else width
    if value % (2 * factor):
        raise PipelineError(
            f"Setting `sampling.{name}` (or `sampling.resolution`) = {value} must be a multiple "
            f"of {2 * factor}: the VAE downsamples by {factor} and the transformer's patches are "
            "2 latent pixels wide."
        )
    return value // factor


def _vae_field(folder: pathlib.Path | None, name: str, default: Any) -> Any:
    """A field of the pipeline's `vae/config.json` (`default` without a folder, or where the
    file leaves it out)."""
    if folder is None or not (folder / "vae").is_dir():
        return default
    return read_json(folder / "vae" / "config.json", "the pipeline's VAE").get(name, default)


def _positive_int(value: Any, folder: pathlib.Path | None, name: str) -> int:
    if type(value) is not int or value < 1:
        raise PipelineError(
            f"{folder} vae/config.json gives `{name}` = {value!r}; a positive int was expected."
        )
    return value


def _image_vae(folder: pathlib.Path | None) -> tuple[int, int]:
    """`AutoencoderKL`'s downsampling and latent channels, as `StableDiffusion3Pipeline` and
    `FluxPipeline` compute them from its config: `vae_scale_factor = 2 **
    (len(block_out_channels) - 1)` (8 for the published VAEs) and `latent_channels`."""
    levels = _vae_field(folder, "block_out_channels", [128, 256, 512, 512])  # SD3's, FLUX's
    if not isinstance(levels, list) or not levels:
        raise PipelineError(
            f"{folder} vae/config.json gives `block_out_channels` = {levels!r}; a non-empty "
            "list was expected."
        )
    channels = _positive_int(_vae_field(folder, "latent_channels", 16), folder, "latent_channels")
    return 2 ** (len(levels) - 1), channels


@final
class SD3Kind(AbstractPipelineKind):
    """SD3 and SD3.5 (`StableDiffusion3Pipeline`): `MMDiT`, `AutoencoderKL`, CLIP-L, OpenCLIP
    bigG and T5 joined as `encode_prompt` joins them, classifier-free guidance."""

    pipeline_class: ClassVar[str] = "StableDiffusion3Pipeline"
    subfolders: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "tokenizer",
        "tokenizer_2",
        "tokenizer_3",
    )
    select: ClassVar[tuple[str, ...] | str] = ("context", "pooled")
    needs_null: ClassVar[bool] = True

    def latent_shape(
        self, config: FinetuneConfig, folder: pathlib.Path | None = None
    ) -> tuple[int, ...]:
        factor, channels = _image_vae(folder)
        height, width = _side(config, "height", factor), _side(config, "width", factor)
        if height != width:
            raise PipelineError(
                "SD3's transformer takes square images: set `sampling.resolution` rather than "
                f"`sampling.height` ({height * factor}) and `sampling.width` ({width * factor})."
            )
        return (height, height, channels)

    def transformer(self, folder: pathlib.Path | None, config: FinetuneConfig) -> Any:
        size = self.latent_shape(config, folder)[0]
        length = 77 + (config.prompts.text_length or 256)
        if folder is None:
            settings = MMDiT.sd35_medium_config()
            return random_model(
                lambda key: MMDiT(
                    **{**settings, "image_size": size, "context_length": length}, key=key
                ),
                _dtype(config),
            )
        return load_diffusers(
            folder / "transformer", image_size=size, context_length=length, dtype=_dtype(config)
        )

    def vae(self, folder: pathlib.Path | None, config: FinetuneConfig) -> AbstractAutoEncoder:
        if folder is None:
            return _random_vae(
                lambda key: AutoencoderKL(**AutoencoderKL.sd3_config(), key=key), _dtype(config)
            )
        vae = load_diffusers(folder / "vae", dtype=_dtype(config))
        return _checked_vae(vae, AutoencoderKL, folder)

    def text(self, folder: pathlib.Path | None, config: FinetuneConfig, model: Any) -> TextSide:
        length = config.prompts.text_length or 256
        dtype = _dtype(config)
        if folder is None:
            shapes = {"context": (77 + length, model.context_dim), "pooled": (model.pooled_dim,)}
            return TextSide(lambda prompts: random_rows(shapes, prompts, dtype))
        encoder = SD3PromptEncoder(
            _clip(folder / "text_encoder", dtype),
            _clip(folder / "text_encoder_2", dtype),
            load_t5(folder / "text_encoder_3", dtype=dtype),
        )
        tokenizers = (
            PromptTokenizer(folder / "tokenizer", 77),
            PromptTokenizer(folder / "tokenizer_2", 77),
            PromptTokenizer(folder / "tokenizer_3", length),
        )
        run = jit_encoder(encoder, lambda enc, ids: enc(*ids))

        def encode(prompts: list[str]) -> Rows:
            ids = [jnp.asarray(tokenizer(prompts)) for tokenizer in tokenizers]
            return numpy_rows(run(*ids), dtype)

        return TextSide(encode)

    def process(self, folder: pathlib.Path | None, config: FinetuneConfig) -> RectifiedFlow:
        return RectifiedFlow(shift=self.scheduler_shift(folder, 3.0), grid=DiffusersGrid())

    def guidance(self, config: FinetuneConfig) -> AbstractGuidance | None:
        scale = config.sampling.guidance_scale
        return None if scale is None or scale <= 1.0 else CFG(scale)


@final
class FluxKind(AbstractPipelineKind):
    """FLUX.1-dev and FLUX.1-schnell (`FluxPipeline`): `Flux`, `AutoencoderKL`, CLIP-L's
    pooled state and T5's states, the guidance embedded (dev) or none (schnell)."""

    pipeline_class: ClassVar[str] = "FluxPipeline"
    subfolders: ClassVar[tuple[str, ...]] = (
        "transformer",
        "vae",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
    )
    select: ClassVar[tuple[str, ...] | str] = ("context", "pooled")
    needs_null: ClassVar[bool] = False

    def __init__(self, distilled_guidance: bool) -> None:
        self.distilled_guidance = distilled_guidance

    def latent_shape(
        self, config: FinetuneConfig, folder: pathlib.Path | None = None
    ) -> tuple[int, ...]:
        factor, channels = _image_vae(folder)
        return (_side(config, "height", factor), _side(config, "width", factor), channels)

    def transformer(self, folder: pathlib.Path | None, config: FinetuneConfig) -> Any:
        height, width, _ = self.latent_shape(config, folder)
        length = config.prompts.text_length or 512
        if folder is None:
            settings = Flux.dev_config() if self.distilled_guidance else Flux.schnell_config()
            return random_model(
                lambda key: Flux(
                    **{**settings, "image_size": (height, width), "context_length": length},
                    key=key,
                ),
                _dtype(config),
            )
        return load_diffusers(
            folder / "transformer",
            image_size=(height, width),
            context_length=length,
            dtype=_dtype(config),
        )

    def vae(self, folder: pathlib.Path | None, config: FinetuneConfig) -> AbstractAutoEncoder:
        if folder is None:
            return _random_vae(
                lambda key: AutoencoderKL(**AutoencoderKL.flux_config(), key=key), _dtype(config)
            )
        return _checked_vae(
            load_diffusers(folder / "vae", dtype=_dtype(config)), AutoencoderKL, folder
        )

    def text(self, folder: pathlib.Path | None, config: FinetuneConfig, model: Any) -> TextSide:
        length = config.prompts.text_length or 512
        dtype = _dtype(config)
        if folder is None:
            shapes = {"context": (length, model.context_dim), "pooled": (model.pooled_dim,)}
            return TextSide(lambda prompts: random_rows(shapes, prompts, dtype))
        encoder = FluxPromptEncoder(
            _clip(folder / "text_encoder", dtype), load_t5(folder / "text_encoder_2", dtype=dtype)
        )
        tokenizers = (
            PromptTokenizer(folder / "tokenizer", 77),
            PromptTokenizer(folder / "tokenizer_2", length),
        )
        run = jit_encoder(encoder, lambda enc, ids: enc(*ids))

        def encode(prompts: list[str]) -> Rows:
            ids = [jnp.asarray(tokenizer(prompts)) for tokenizer in tokenizers]
            return numpy_rows(run(*ids), dtype)

        return TextSide(encode)

    def process(self, folder: pathlib.Path | None, config: FinetuneConfig) -> RectifiedFlow:
        height, width, _ = self.latent_shape(config, folder)
        scheduler: dict[str, Any] = {"use_dynamic_shifting": self.distilled_guidance}
        if folder is not None and (folder / "scheduler").is_dir():
            scheduler = read_json(folder / "scheduler" / "scheduler_config.json", "the scheduler")
        if scheduler.get("use_dynamic_shifting", self.distilled_guidance):
            # FluxPipeline's `calculate_shift`, with its scheduler's fields.
            shift = flux_shift(
                (height // 2) * (width // 2),
                base_tokens=int(scheduler.get("base_image_seq_len", 256)),
                max_tokens=int(scheduler.get("max_image_seq_len", 4096)),
                base_shift=float(scheduler.get("base_shift", 0.5)),
                max_shift=float(scheduler.get("max_shift", 1.15)),
            )
            return RectifiedFlow(shift=shift, grid=FluxGrid())
        return RectifiedFlow(shift=self.scheduler_shift(folder, 1.0), grid=FluxGrid())

    def guidance(self, config: FinetuneConfig) -> AbstractGuidance | None:
        if not self.distilled_guidance:
            return None
        return EmbeddedGuidance(config.sampling.guidance_scale or 0.0)


@final
class WanKind(AbstractPipelineKind):
    """Wan 2.1 text-to-video (`WanPipeline`): `Wan`, `AutoencoderKLWan`, umT5's states with
    the padding zeroed, classifier-free guidance with the negative prompt."""

    pipeline_class: ClassVar[str] = "WanPipeline"
    subfolders: ClassVar[tuple[str, ...]] = ("transformer", "vae", "text_encoder", "tokenizer")
    select: ClassVar[tuple[str, ...] | str] = "context"
    needs_null: ClassVar[bool] = True

    def latent_shape(
        self, config: FinetuneConfig, folder: pathlib.Path | None = None
    ) -> tuple[int, ...]:
        # WanPipeline's `vae_scale_factor_temporal` and `_spatial` (4 and 8 published) and
        # the latent channels, `z_dim` (16 published), from the VAE's config.
        temporal = _positive_int(
            _vae_field(folder, "scale_factor_temporal", 4), folder, "scale_factor_temporal"
        )
        spatial = _positive_int(
            _vae_field(folder, "scale_factor_spatial", 8), folder, "scale_factor_spatial"
        )
        channels = _positive_int(_vae_field(folder, "z_dim", 16), folder, "z_dim")
        frames = config.sampling.frames or 1
        if (frames - 1) % temporal:
            raise PipelineError(
                f"Setting `sampling.frames` = {frames} must be 1 + {temporal}k: Wan's VAE keeps "
                f"the first frame and compresses the rest by {temporal}."
            )
        return (
            1 + (frames - 1) // temporal,
            _side(config, "height", spatial),
            _side(config, "width", spatial),
            channels,
        )

    def transformer(self, folder: pathlib.Path | None, config: FinetuneConfig) -> Any:
        size = self.latent_shape(config, folder)[:3]
        length = config.prompts.text_length or 512
        if folder is None:
            return random_model(
                lambda key: Wan(
                    **{**Wan.t2v_1_3b_config(), "latent_size": size, "context_length": length},
                    key=key,
                ),
                _dtype(config),
            )
        return load_diffusers(
            folder / "transformer", image_size=size, context_length=length, dtype=_dtype(config)
        )

    def vae(self, folder: pathlib.Path | None, config: FinetuneConfig) -> AbstractAutoEncoder:
        if folder is None:
            return _random_vae(
                lambda key: AutoencoderKLWan(**AutoencoderKLWan.wan_2_1_config(), key=key),
                _dtype(config),
            )
        return _checked_vae(
            load_diffusers(folder / "vae", dtype=_dtype(config)), AutoencoderKLWan, folder
        )

    def text(self, folder: pathlib.Path | None, config: FinetuneConfig, model: Any) -> TextSide:
        length = config.prompts.text_length or 512
        dtype = _dtype(config)
        if folder is None:
            shapes = {"context": (length, model.text_dim)}
            return TextSide(lambda prompts: random_rows(shapes, prompts, dtype))
        encoder = WanPromptEncoder(load_t5(folder / "text_encoder", dtype=dtype))
        tokenizer = PromptTokenizer(folder / "tokenizer", length)
        run = jit_encoder(encoder, lambda enc, ids: enc(*ids))

        def encode(prompts: list[str]) -> Rows:
            ids, mask = tokenizer.encode([wan_prompt_clean(prompt) for prompt in prompts])
            return numpy_rows(run(jnp.asarray(ids), jnp.asarray(mask)), dtype)

        return TextSide(encode)

    def process(self, folder: pathlib.Path | None, config: FinetuneConfig) -> RectifiedFlow:
        return RectifiedFlow(shift=self.scheduler_shift(folder, 3.0))

    def guidance(self, config: FinetuneConfig) -> AbstractGuidance | None:
        scale = config.sampling.guidance_scale
        return None if scale is None or scale <= 1.0 else CFG(scale)


def wan_prompt_clean(prompt: str) -> str:
    """A prompt as `WanPipeline` cleans it before its tokenizer: `ftfy.fix_text` where `ftfy`
    is installed (as diffusers does), HTML entities unescaped twice, runs of whitespace made one
    space, the ends stripped.

    **Arguments:**

    - `prompt`: the prompt.

    **Returns:**

    The cleaned prompt.
    """
    try:
        import ftfy  # type: ignore[import-not-found, unused-ignore]

        prompt = ftfy.fix_text(prompt)
    except ImportError:
        pass
    prompt = html.unescape(html.unescape(prompt)).strip()
    return re.sub(r"\s+", " ", prompt).strip()


PIPELINE_KINDS: dict[ModelKind, AbstractPipelineKind] = {
    "sd3": SD3Kind(),
    "flux-dev": FluxKind(distilled_guidance=True),
    "flux-schnell": FluxKind(distilled_guidance=False),
    "wan": WanKind(),
}
"""How each model kind's pipeline is read."""


def random_model(make: Callable[[Any], Any], dtype: Any) -> Any:  # noqa: ANN401
    """A model of random weights in `dtype`: its structure traced abstractly from `make(key)`,
    each floating-point weight drawn from N(0, 0.02^2) by a small program per shape (a stacked
    model has few), so no program of the whole model's size is compiled."""
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(abstract)
    drawn = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            drawn.append(leaf)
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            drawn.append(_normal(jax.random.key(index), leaf.shape, jnp.dtype(dtype)))
        else:
            drawn.append(jnp.zeros(leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, drawn)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _random_vae(make: Callable[[Any], Any], dtype: Any) -> AbstractAutoEncoder:
    """A VAE of random weights (`random_model`)."""
    vae: AbstractAutoEncoder = random_model(make, dtype)
    return vae


def _clip(folder: pathlib.Path, dtype: Any) -> Any:
    from ..models import CLIPTextModel

    model = load_clip(folder, dtype=dtype)
    if not isinstance(model, CLIPTextModel):
        raise PipelineError(
            f"{folder} holds a {type(model).__name__}; a pipeline's text encoder is a "
            "CLIPTextModel or CLIPTextModelWithProjection."
        )
    return model


def _checked_vae(vae: Any, expected: type[Any], folder: pathlib.Path) -> AbstractAutoEncoder:
    if not isinstance(vae, expected):
        raise PipelineError(
            f"{folder / 'vae'} holds a {type(vae).__name__}; this pipeline's VAE is an "
            f"{expected.__name__}."
        )
    checked: AbstractAutoEncoder = vae
    return checked
