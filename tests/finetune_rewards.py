"""Host rewards for the finetune tests, loaded as `tests.finetune_rewards:NAME` (a config's
`[reward.<name>] kind = "python"`, or served by `flowgrpo_eqx.rewards.server`)."""

import json

import numpy as np


def brightness_and_prompt(samples, rows):
    """Mean brightness plus 1e-3 per character of the prompt and 1e-2 if the prompt's
    metadata has a `tag`: scores that show the rows reach the reward."""
    flat = np.asarray(samples, dtype=np.float64).reshape(samples.shape[0], -1)
    lengths = np.char.str_len(rows["prompt"]).astype(np.float64)
    tagged = np.asarray([1.0 if "tag" in json.loads(m) else 0.0 for m in rows["metadata"]])
    return flat.mean(axis=1) + 1e-3 * lengths + 1e-2 * tagged


def nan_reward(samples, rows):
    del rows
    return np.full(samples.shape[0], np.nan)


def one_short(samples, rows):
    del rows
    return np.zeros(samples.shape[0] - 1)
