"""Rewards for failure tests, loaded by the command line through `--custom-reward`."""

import numpy as np


class FailingReward:
    """A reward that always raises, as a broken reward service would."""

    name = "injected_failure"

    def __call__(self, samples, rows):
        raise RuntimeError("this reward always fails")


def brightness(samples, rows):
    """Mean pixel value per sample, a cheap dense reward."""
    return np.asarray(samples, np.float64).reshape(len(samples), -1).mean(axis=1)
