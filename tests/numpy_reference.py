"""Independent float64 NumPy statements of DESIGN section 3, used by the tests as the oracle.

Nothing here imports `flowgrpo_eqx`: every formula is written out again from the design.
"""

import math

import numpy as np


def grid(steps: int, shift: float = 1.0) -> np.ndarray:
    u = np.linspace(1.0, 0.0, steps, dtype=np.float64)
    return shift * u / (1.0 + (shift - 1.0) * u)


def stochastic(t, t_next, noise_level, kind="flow", window=None):
    t = np.asarray(t, np.float64)
    t_next = np.asarray(t_next, np.float64)
    out = np.full(np.broadcast(t, t_next).shape, noise_level > 0)
    if window is not None:
        start, stop = window
        out &= (t <= start + 1e-6) & (t_next >= stop - 1e-6)
    if kind == "cps":
        out &= t_next > 0
    return out


def flow_transition(x, v, t, t_next, noise_level):
    """Flow-GRPO SDE step of one latent; returns (mean, std)."""
    x = np.asarray(x, np.float64)
    v = np.asarray(v, np.float64)
    dt = t_next - t
    t_star = t_next if t == 1.0 else t
    sigma = noise_level * math.sqrt(t / (1.0 - t_star))
    mean = x * (1 + sigma**2 / (2 * t) * dt) + v * (1 + sigma**2 * (1 - t) / (2 * t)) * dt
    return mean, sigma * math.sqrt(-dt)


def cps_transition(x, v, t, t_next, noise_level):
    x = np.asarray(x, np.float64)
    v = np.asarray(v, np.float64)
    std = t_next * math.sin(noise_level * math.pi / 2)
    x0 = x - t * v
    x1 = x + (1 - t) * v
    return x0 * (1 - t_next) + x1 * math.sqrt(t_next**2 - std**2), std


def transition(x, v, t, t_next, noise_level, kind="flow", window=None):
    level = noise_level if stochastic(t, t_next, noise_level, kind, window) else 0.0
    if kind == "flow":
        return flow_transition(x, v, t, t_next, level)
    return cps_transition(x, v, t, t_next, level)


def log_prob(x_next, mean, std):
    if std == 0:
        return 0.0
    r = np.asarray(x_next, np.float64) - np.asarray(mean, np.float64)
    return float(np.mean(-(r**2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)))


def kl_paper(mean, mean_ref, std):
    if std == 0:
        return 0.0
    d = np.asarray(mean, np.float64) - np.asarray(mean_ref, np.float64)
    return float(np.mean(d**2) / (2 * std**2))


def kl_released(mean, mean_ref, sigma):
    """The released train_sd3.py term: squared mean displacement over 2 sigma^2 (no dt)."""
    if sigma == 0:
        return 0.0
    d = np.asarray(mean, np.float64) - np.asarray(mean_ref, np.float64)
    return float(np.mean(d**2) / (2 * sigma**2))


def surrogate(advantage, ratio, clip_range, adv_clip_max):
    a = float(np.clip(advantage, -adv_clip_max, adv_clip_max))
    return max(-a * ratio, -a * float(np.clip(ratio, 1 - clip_range, 1 + clip_range)))


def group_advantages(rewards, groups, eps=1e-4, std="group"):
    r = np.asarray(rewards, np.float64).reshape(-1, groups)
    out = np.empty_like(r)
    for p in range(r.shape[0]):
        mean = sum(r[p]) / groups
        if std == "group":
            spread = math.sqrt(sum((x - mean) ** 2 for x in r[p]) / groups)
        else:
            flat = r.reshape(-1)
            m = sum(flat) / flat.size
            spread = math.sqrt(sum((x - m) ** 2 for x in flat) / flat.size)
        for i in range(groups):
            out[p, i] = 0.0 if np.all(r[p] == r[p, 0]) else (r[p, i] - mean) / (spread + eps)
    return out.reshape(-1)
