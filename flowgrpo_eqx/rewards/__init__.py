"""Rewards computed on the accelerator from decoded images: CLIP's towers in JAX
(`flowgrpo_eqx.models.CLIPModel`), jit-compiled, vmapped over a batch.

`PickScore` scores one image against one prompt's embedding as flow_grpo's PickScore scorer
does, `CLIPScore` as torchmetrics' CLIP score does; `DeviceReward` makes any such per-sample
score a `FlowReward` that a `FlowRollout` takes as it takes a host reward (it compiles the
score once and returns float64 scores).
"""

from ._clip_score import CLIPScore as CLIPScore
from ._device import DeviceReward as DeviceReward
from ._features import AbstractCLIPReward as AbstractCLIPReward
from ._pickscore import PickScore as PickScore
