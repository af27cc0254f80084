"""Rewards for tests: loaded by `--custom-reward` or a reward server, or imported (`brightness`,
the cheap dense reward every test that needs one shares)."""

import os

import numpy as np


class FailingReward:
    """A reward that always raises, as a broken reward service would."""

    name = "injected_failure"

    def __call__(self, samples, rows):
        raise RuntimeError("this reward always fails")


def brightness(samples, rows):
    """Mean pixel value per sample in float64, a cheap dense reward (the scores' dtype a
    reward must return)."""
    return np.asarray(samples, np.float64).reshape(len(samples), -1).mean(axis=1)


class CountedJpegIncompressibility:
    """DDPO's JPEG-size reward that also appends one line per call to `$REWARD_CALLS_FILE`,
    so a test can count how often a reward server was asked to score."""

    name = "jpeg_incompressibility"

    def __call__(self, samples, rows):
        from flowgrpo_eqx import JpegIncompressibility

        with open(os.environ["REWARD_CALLS_FILE"], "a") as handle:
            handle.write(f"{len(samples)}\n")
        return JpegIncompressibility()(samples, rows)
