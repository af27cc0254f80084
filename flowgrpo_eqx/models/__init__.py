"""Small conditional velocity networks `model(x, t, cond) -> v` on one unbatched example."""

from ._clip import (
    Activation as Activation,
    CLIPModel as CLIPModel,
    CLIPTextModel as CLIPTextModel,
    TextOutput as TextOutput,
    TowerShape as TowerShape,
    clip_pixels as clip_pixels,
    load_clip as load_clip,
)
from ._diffusers import (
    DiffusersModel as DiffusersModel,
    DiffusersTransformer as DiffusersTransformer,
    diffusers_layers as diffusers_layers,
    load_diffusers as load_diffusers,
    save_diffusers as save_diffusers,
    save_diffusers_lora as save_diffusers_lora,
)
from ._dit import DiT as DiT
from ._flux import Flux as Flux, FluxCondition as FluxCondition
from ._layers import (
    ATTENTION_NAMES as ATTENTION_NAMES,
    AbstractAttention as AbstractAttention,
    AutoAttention as AutoAttention,
    ChunkedAttention as ChunkedAttention,
    CudnnAttention as CudnnAttention,
    PlainAttention as PlainAttention,
    SplashAttention as SplashAttention,
    attention_from_name as attention_from_name,
    sinusoidal_time_features as sinusoidal_time_features,
)
from ._mlp import MLPVelocity as MLPVelocity, silu as silu
from ._mmdit import MMDiT as MMDiT, MMDiTCondition as MMDiTCondition
from ._prompts import (
    FluxPromptEncoder as FluxPromptEncoder,
    PromptTokenizer as PromptTokenizer,
    SD3PromptEncoder as SD3PromptEncoder,
    WanPromptEncoder as WanPromptEncoder,
)
from ._sequence_strategy import (
    SEQUENCE_STRATEGY_NAMES as SEQUENCE_STRATEGY_NAMES,
    AbstractSequenceStrategy as AbstractSequenceStrategy,
    RingSequence as RingSequence,
    SequenceStrategy as SequenceStrategy,
    UlyssesSequence as UlyssesSequence,
    sequence_strategy_from_name as sequence_strategy_from_name,
)
from ._stacked import (
    REMAT_NAMES as REMAT_NAMES,
    AbstractRemat as AbstractRemat,
    BlockRemat as BlockRemat,
    Remat as Remat,
    SaveAttention as SaveAttention,
    SaveDots as SaveDots,
    SaveNothing as SaveNothing,
    SaveQKV as SaveQKV,
    remat_from_name as remat_from_name,
)
from ._t5 import FeedForward as FeedForward, T5Encoder as T5Encoder, load_t5 as load_t5
from ._vae import AutoencoderKL as AutoencoderKL
from ._wan import Wan as Wan
from ._wan_vae import AutoencoderKLWan as AutoencoderKLWan
