"""Rewards: what a reward is, and every reward the library ships or serves.

- The protocol: a `FlowReward` scores `[N, *sample]` host samples with their prompt rows and
  returns `[N]` float64 scores; `RewardError` is what a failing reward raises;
  `check_finite_samples`, `load_reward` (a `module:function` or `module:Class` by name),
  `score` (a reward's checked float64 scores, in blocks) and `reward_name`.
- Host rewards: `WeightedReward` (a weighted sum of rewards), `JpegCompressibility` and
  `JpegIncompressibility` (DDPO's JPEG-size rewards).
- A reward in another process: `HttpReward`, the client of `flowgrpo_eqx.rewards.server`
  (which needs the `server` extra, aiohttp, and is imported only where used); the server's
  limits and their flags are in `flowgrpo_eqx.rewards.limits`.
- Rewards on the accelerator, from decoded images: CLIP's towers in JAX
  (`flowgrpo_eqx.models.CLIPModel`), jit-compiled, vmapped over a batch. `PickScore` scores
  one image against one prompt's embedding as flow_grpo's PickScore scorer does, `CLIPScore`
  as torchmetrics' CLIP score does; `DeviceReward` makes any such per-sample score a
  `FlowReward` that a `FlowRollout` takes as it takes a host reward (it compiles the score
  once and returns float64 scores).
- Many processes: `score_on_root` runs a reward once, on process 0, and gives its scores to
  every process.
"""

from ._clip_score import CLIPScore as CLIPScore
from ._device import DeviceReward as DeviceReward
from ._features import AbstractCLIPReward as AbstractCLIPReward
from ._http import HttpReward as HttpReward
from ._jpeg import (
    JpegCompressibility as JpegCompressibility,
    JpegIncompressibility as JpegIncompressibility,
)
from ._on_root import score_on_root as score_on_root
from ._pickscore import PickScore as PickScore
from ._reward import (
    FlowReward as FlowReward,
    RewardError as RewardError,
    WeightedReward as WeightedReward,
    check_finite_samples as check_finite_samples,
    load_reward as load_reward,
    reward_name as reward_name,
    score as score,
    to_uint8_images as to_uint8_images,
)
