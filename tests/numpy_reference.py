"""Independent float64 NumPy statements of `docs/mathematics/`: the tests' only oracle.

Nothing here imports `flowgrpo_eqx`: every formula is written out again from that page. The
example tests and the Hypothesis properties both import it.
"""

import math

import numpy as np


def grid(steps: int, shift: float = 1.0) -> np.ndarray:
    u = np.linspace(1.0, 0.0, steps, dtype=np.float64)
    return shift * u / (1.0 + (shift - 1.0) * u)


def stochastic(t, t_next, noise_level, kind="flow", window=None):
    """Whether each transition samples noise: level > 0, inside the window (to 1e-6), and for
    CPS not the last step."""
    t = np.asarray(t, np.float64)
    t_next = np.asarray(t_next, np.float64)
    out = np.full(np.broadcast(t, t_next).shape, noise_level > 0)
    if window is not None:
        start, stop = window
        out &= (t <= start + 1e-6) & (t_next >= stop - 1e-6)
    if kind == "cps":
        out &= t_next > 0
    return out


def gaussian(x, v, t, t_next, level, kind="flow"):
    """The SDE step's (mean, std) at noise `level`, for one latent or a batch of rows.

    `x`, `v`: `[*latent]` or `[N, *latent]`; `t`, `t_next`, `level`: scalars or `[N]`.
    """
    x = np.asarray(x, np.float64)
    v = np.asarray(v, np.float64)
    t = np.asarray(t, np.float64)
    t_next = np.asarray(t_next, np.float64)
    level = np.asarray(level, np.float64)

    def per_row(a):
        return a.reshape(a.shape + (1,) * (x.ndim - a.ndim))

    dt = t_next - t
    if kind == "flow":
        t_star = np.where(t == 1.0, t_next, t)
        with np.errstate(divide="ignore", invalid="ignore"):
            sigma = level * np.sqrt(t / (1.0 - t_star))
        sigma = np.where(level > 0, sigma, 0.0)
        s2 = sigma**2
        mean = x * per_row(1 + s2 * dt / (2 * t)) + v * per_row((1 + s2 * (1 - t) / (2 * t)) * dt)
        return mean, sigma * np.sqrt(-dt)
    std = t_next * np.sin(level * math.pi / 2)
    x0 = x - per_row(t) * v
    x1 = x + per_row(1 - t) * v
    return x0 * per_row(1 - t_next) + x1 * per_row(np.sqrt(t_next**2 - std**2)), std


def transition(x, v, t, t_next, noise_level, kind="flow", window=None):
    """One latent's SDE step `(mean, std)`; deterministic (level 0) outside the stochastic set."""
    level = noise_level if stochastic(t, t_next, noise_level, kind, window) else 0.0
    mean, std = gaussian(x, v, t, t_next, level, kind)
    return mean, float(std)


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


def ratio_norm(log_ratio, std, kept):
    """GRPO-Guard's RatioNorm (§5a): per step, the std-scaled log-ratio minus its kept mean."""
    log_ratio, std = np.asarray(log_ratio, np.float64), np.asarray(std, np.float64)
    out = np.zeros_like(log_ratio)
    for j in range(log_ratio.shape[1]):
        rows = [i for i in range(log_ratio.shape[0]) if kept[i, j]]
        if not rows:
            continue
        scaled = {i: log_ratio[i, j] * std[i, j] for i in rows}
        centre = sum(scaled.values()) / len(rows)
        for i in rows:
            out[i, j] = scaled[i] - centre
    return out


def step_weights(t, t_next, kept):
    """GRPO-Guard's reweighting (§5a): 1/dt over the kept set's mean of 1/dt; 0 elsewhere."""
    inverse = {
        (i, j): 1.0 / (float(t[i, j]) - float(t_next[i, j]))
        for i in range(kept.shape[0])
        for j in range(kept.shape[1])
        if kept[i, j]
    }
    out = np.zeros(kept.shape)
    if inverse:
        mean = sum(inverse.values()) / len(inverse)
        for (i, j), value in inverse.items():
            out[i, j] = value / mean
    return out


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


def unbiased_std(values):
    """torch's `x.std()`: the Bessel-corrected (ddof 1) standard deviation, in float64."""
    values = [float(x) for x in values]
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (len(values) - 1))


def dancegrpo_advantages(rewards, groups):
    """DanceGRPO's group advantages (`train_grpo_flux.py` `train_one_step`, `use_group`):
    `(r - group_rewards.mean()) / (group_rewards.std() + 1e-8)`, torch's unbiased std."""
    r = np.asarray(rewards, np.float64)
    out = np.empty_like(r)
    for start in range(0, r.size, groups):
        group = r[start : start + groups]
        mean = math.fsum(group) / groups
        spread = unbiased_std(group) + 1e-8
        out[start : start + groups] = [(x - mean) / spread for x in group]
    return out


def unirl_global_std_advantages(rewards, groups):
    """UniRL's `RolloutTrack.compute_advantages(use_global_std=True)` (Flow-DPPO's recipe):
    each group's mean, one batch-wide `rewards.std() + 1e-8`, torch's unbiased std."""
    r = np.asarray(rewards, np.float64)
    spread = unbiased_std(r) + 1e-8
    out = np.empty_like(r)
    for start in range(0, r.size, groups):
        group = r[start : start + groups]
        mean = math.fsum(group) / groups
        out[start : start + groups] = [(x - mean) / spread for x in group]
    return out


def per_reward_advantages(components, weights, groups, eps=1e-4):
    """`sum_k w_k (r_k - mean_group) / (std_group + eps)`, term by term, in float64."""
    scores = np.asarray(components, np.float64)
    total = np.zeros(scores.shape[1])
    for weight, row in zip(weights, scores, strict=True):
        for start in range(0, row.size, groups):
            group = row[start : start + groups]
            mean = math.fsum(group) / groups
            spread = math.sqrt(math.fsum((x - mean) ** 2 for x in group) / groups)
            constant = bool(np.all(group == group[0]))
            for i, x in enumerate(group):
                term = 0.0 if constant else (x - mean) / (spread + eps)
                total[start + i] += float(weight) * term
    return total


def nft_loss(data, noise, t, v_theta, v_old, advantages, mask, beta, adv_max):
    """DiffusionNFT (mathematics/nft.md §8), row by row in float64: `(total, count)`.

    `data`, `noise`, `v_theta`, `v_old`: `[N, D]`; `t`, `advantages`: `[N]`; `mask`: `[N]`.
    `v_theta` and `v_old` are the velocities at `x_t = (1 - t) data + t noise`.
    """
    total = 0.0
    count = 0
    for i in range(len(mask)):
        if not mask[i]:
            continue
        target = np.asarray(noise[i], np.float64) - np.asarray(data[i], np.float64)
        theta = np.asarray(v_theta[i], np.float64)
        old = np.asarray(v_old[i], np.float64)
        r = 0.5 + 0.5 * min(max(float(advantages[i]) / adv_max, -1.0), 1.0)
        positive = (1.0 - beta) * old + beta * theta
        negative = (1.0 + beta) * old - beta * theta
        total += r * np.mean((positive - target) ** 2) + (1.0 - r) * np.mean(
            (negative - target) ** 2
        )
        count += 1
    return total, count


def guard_released(log_ratio, drift, std, t, t_next, kept, drift_mode, scale_mode, reweight):
    """GRPO-Guard as released (§5a): `(guarded log-ratio, weights)`, both `[N, K]`.

    Per step column `k` over its kept rows: `sqrt_dt = sqrt(t - t_next)`, `sigma_t = s / sqrt_dt`,
    `S = mean(sqrt_dt) * mean(sigma_t)` (`scale_mode="batch"`) or `S = s` (`"sample"`);
    `drift` is `mean over coordinates (mu_theta - mu_old)^2`, used per transition
    (`drift_mode="sample"`) or as its mean over the column's kept rows (`"batch"`, issue
    #244: the released `mean(dim=())` reduces over the batch and the coordinates);
    the guarded log-ratio is `(log_ratio + drift / (2 S^2)) * S`; with `reweight` each kept
    surrogate is divided by `mean(sqrt_dt)^2`, else weighted 1.
    """
    n, k = kept.shape
    out = np.zeros((n, k))
    weights = np.zeros((n, k))
    for j in range(k):
        rows = [i for i in range(n) if kept[i, j]]
        if not rows:
            continue
        sqrt_dt = {i: math.sqrt(float(t[i, j]) - float(t_next[i, j])) for i in rows}
        sigma = {i: float(std[i, j]) / sqrt_dt[i] for i in rows}
        mean_sqrt_dt = sum(sqrt_dt.values()) / len(rows)
        batch_scale = mean_sqrt_dt * sum(sigma.values()) / len(rows)
        batch_drift = sum(float(drift[i, j]) for i in rows) / len(rows)
        for i in rows:
            scale = batch_scale if scale_mode == "batch" else float(std[i, j])
            d = batch_drift if drift_mode == "batch" else float(drift[i, j])
            out[i, j] = (float(log_ratio[i, j]) + d / (2 * scale**2)) * scale
            weights[i, j] = 1.0 / mean_sqrt_dt**2 if reweight else 1.0
    return out, weights


def nft_released_row(
    data, noise, t, v_theta, v_old, v_ref, advantage, beta, adv_max, kl_beta, weights=None
):
    """DiffusionNFT as released (§8), one row at one time, in float64: `(loss, (w+, w-))`.

    `x_t = (1 - t) x_0 + t eps`; `v+ = beta v_theta + (1 - beta) v_old`,
    `v- = (1 + beta) v_old - beta v_theta`; `e+- = (x_t - t v+-) - x_0`;
    `w+- = max(mean|e+-|, 1e-5)` (no gradient: pass `weights` to hold them fixed);
    `r = clip(clip(A, -adv_max, adv_max) / adv_max / 2 + 1/2, 0, 1)`;
    loss `= adv_max * (r mean(e+^2) / w+ + (1 - r) mean(e-^2) / w-) / beta
    + kl_beta mean (v_theta - v_ref)^2`.
    """
    x0 = np.asarray(data, np.float64)
    x_t = (1 - t) * x0 + t * np.asarray(noise, np.float64)
    theta = np.asarray(v_theta, np.float64)
    old = np.asarray(v_old, np.float64)
    positive = beta * theta + (1 - beta) * old
    negative = (1 + beta) * old - beta * theta
    e_pos = (x_t - t * positive) - x0
    e_neg = (x_t - t * negative) - x0
    if weights is None:
        weights = (max(np.mean(np.abs(e_pos)), 1e-5), max(np.mean(np.abs(e_neg)), 1e-5))
    a = min(max(float(advantage), -adv_max), adv_max)
    r = min(max(a / adv_max / 2 + 0.5, 0.0), 1.0)
    policy = (
        r * np.mean(e_pos**2) / weights[0] / beta + (1 - r) * np.mean(e_neg**2) / weights[1] / beta
    )
    kl = np.mean((theta - np.asarray(v_ref, np.float64)) ** 2)
    return adv_max * policy + kl_beta * kl, weights


def nft_decay(step, flat, rate, maximum):
    """The released old-policy decay `eta`: 0 before `flat`, then `min((step - flat) rate, max)`."""
    return 0.0 if step < flat else min((step - flat) * rate, maximum)


# ---------------------------------------------------------------------------------------------
# AWM (docs/mathematics/awm.md §9), from the authors' release: github
# scxue/advantage_weighted_matching at be51372,
# advantage_weighted_matching/scripts/train_sd3_awm.py (cited below by line).

AWM_RELEASE = "scxue/advantage_weighted_matching@be51372 scripts/train_sd3_awm.py"


def awm_log_prob(v, data, noise, t, weighting="ghuber", power=0.25):
    """`compute_log_prob_awm`, lines 237-251: `e = mean (v - (eps - x_0))^2` in float64, then
    `Uniform` `-e`, `t` `-e t`, `t**2` `-e t^2`, `huber` `-(sqrt(e + 1e-10) - 1e-5) t`,
    `ghuber` `-((e + 1e-10)^p - (1e-10)^p) t / p`."""
    v = np.asarray(v, np.float64)
    target = np.asarray(noise, np.float64) - np.asarray(data, np.float64)
    log_prob = -np.mean((v - target) ** 2)
    t = float(t)
    if weighting == "t":
        return log_prob * t
    if weighting == "t**2":
        return log_prob * t**2
    if weighting == "uniform":
        return log_prob
    if weighting == "huber":
        return -(np.sqrt(-log_prob + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        return -(np.power(-log_prob + 1e-10, power) - np.power(1e-10, power)) * t / power
    raise ValueError(weighting)


def awm_indices(u, grid_size, train_timesteps, timestep_fraction, time_type):
    """The trained grid indices, lines 1172-1205 (`discrete`, `discrete_with_init`,
    `discrete_wo_init`): strata bounds `linspace(start, int(K f), n + 1).long()`, one index
    `lower + long(u (upper - lower))` per stratum (`u` float32, as `torch.rand`); with
    `discrete_with_init`, index 0 first and `n = T - 1` strata from 1."""
    top = int(grid_size * timestep_fraction)
    if time_type == "discrete_with_init":
        start, strata = 1, train_timesteps - 1
    else:
        start, strata = (0 if time_type == "discrete" else 1), train_timesteps
    step = (top - start) / strata
    bounds = [int(start + i * step) if i < strata else top for i in range(strata + 1)]
    u = np.asarray(u, np.float32)
    picked = [
        bounds[i] + int(np.float32(u[i]) * np.float32(bounds[i + 1] - bounds[i]))
        for i in range(strata)
    ]
    return ([0] if time_type == "discrete_with_init" else []) + picked


def awm_advantages(advantages, adv_clip_max, advantage_max):
    """Lines 1293-1299: `clamp(A, -adv_clip_max, adv_clip_max)`, then, when `advantage_max` is
    set, `/ adv_clip_max * advantage_max`."""
    a = np.clip(np.asarray(advantages, np.float64), -adv_clip_max, adv_clip_max)
    return a if advantage_max is None else a / adv_clip_max * advantage_max


def awm_policy_loss(log_probs, old_log_probs, advantages, clip_range, loss_type="exp_first"):
    """Lines 1301-1327, on `[T, B]` log-likelihoods and `[B]` (scaled) advantages:
    `exp_first` ratio `exp(lp - old)` per entry; `sum_first` `exp(mean_T lp - mean_T old)` per
    row; the loss `mean(max(-A r, -A clamp(r, 1 - c, 1 + c)))`. Returns `(loss, ratio)`."""
    lp = np.asarray(log_probs, np.float64)
    old = np.asarray(old_log_probs, np.float64)
    a = np.asarray(advantages, np.float64)
    if loss_type == "sum_first":
        ratio = np.exp(lp.mean(axis=0) - old.mean(axis=0))
    else:
        ratio = np.exp(lp - old).reshape(-1)
        a = np.repeat(a[None, :], lp.shape[0], axis=0).reshape(-1)
    unclipped = -a * ratio
    clipped = -a * np.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return float(np.mean(np.maximum(unclipped, clipped))), ratio


def awm_kl(v, v_other, t, weight="uniform"):
    """Lines 1334-1340 (and 1343-1349 for the EMA): `mean (v - v')^2` per example, over
    `2 std^2` for `ELBO`, `std = sqrt(t / (1 - clamp(t, 0, 0.99))) 0.7` (line 236)."""
    kl = np.mean((np.asarray(v, np.float64) - np.asarray(v_other, np.float64)) ** 2)
    if weight == "uniform":
        return kl
    t = float(t)
    std = np.sqrt(t / (1 - min(max(t, 0.0), 0.99))) * 0.7
    return kl / (2 * std**2)


def awm_ema_decay(global_step, decay_type="linear", kl_ema_decay=0.3):
    """Lines 1410-1413: `constant` `kl_ema_decay`, `linear` `min(kl_ema_decay, 0.001 step)`."""
    if decay_type == "constant":
        return kl_ema_decay
    return min(kl_ema_decay, 0.001 * global_step)


def awm_ema_update(ema, live, decay):
    """Lines 1416-1419: `ema = ema decay + live (1 - decay)`."""
    return np.asarray(ema, np.float64) * decay + np.asarray(live, np.float64) * (1.0 - decay)


# --------------------------------------------------------------------------------------
# MixGRPO (github Tencent-Hunyuan/MixGRPO, `fastvideo/utils/sampling_utils.py`).


def dpm_solver_pp_2m(velocity, x, sigmas, previous=None):
    """DPM-Solver++(2M), midpoint, deterministic, over the grid `sigmas` (from t = 1 to 0):
    `dpm_step` (lines 273-385) with `dpm_algorithm_type="dpmsolver++"`, `dpm_solver_order=2`,
    `dpm_solver_type="midpoint"`, `sde_solver=False`: the data prediction `x - sigma v`
    (`convert_model_output`, lines 387-396) pushed onto the state (`DPMState`, lines
    255-271); first order for the first step and the last (`lower_order_final`, lines
    308 and 328), `dpm_solver_first_order_update` (lines 421-436); otherwise
    `multistep_dpm_solver_second_order_update` (lines 472-520), with `alpha = 1 - sigma`
    (`_sigma_to_alpha_sigma_t`, lines 641-644). `velocity(x, sigma)` in float64.
    `previous=(m, sigma)`: the state after an earlier step from `sigma` with data prediction
    `m` (MixGRPO's steps before the post grid, lines 114-127, update the state too)."""
    x = np.asarray(x, np.float64)
    sigmas = np.asarray(sigmas, np.float64)
    outputs, lower_order_nums, begin = [None, None], 0, 0
    if previous is not None:
        outputs, lower_order_nums, begin = [None, np.asarray(previous[0], np.float64)], 1, 1
        sigmas = np.concatenate([[previous[1]], sigmas])
    steps = sigmas.size - 1

    def lam(s):
        # The grid's first point is 1 up to rounding (a shifted grid may give 1 + 1 ulp).
        s = min(s, 1.0)
        with np.errstate(divide="ignore"):
            return np.log(1 - s) - np.log(s)

    for i in range(begin, steps):
        m0 = x - sigmas[i] * velocity(x, sigmas[i])
        outputs = [outputs[1], m0]
        s_t, s_0 = sigmas[i + 1], sigmas[i]
        a_t = 1 - s_t
        h = lam(s_t) - lam(s_0)
        if lower_order_nums < 1 or i == steps - 1:
            x = (s_t / s_0) * x - (a_t * (np.exp(-h) - 1.0)) * m0
        else:
            h_0 = lam(s_0) - lam(sigmas[i - 1])
            d1 = (1.0 / (h_0 / h)) * (m0 - outputs[0])
            x = (s_t / s_0) * x - (a_t * (np.exp(-h) - 1.0)) * m0
            x = x - 0.5 * (a_t * (np.exp(-h) - 1.0)) * d1
        lower_order_nums = min(lower_order_nums + 1, 2)
    return x


def mixgrpo_post_grid(transitions, last, ratio, shift):
    """`run_sample_step` lines 44-49: after the window's last transition `last` (of
    `transitions`), `n = int(max((T - last) ratio, 1))` points evenly from
    `linspace(1, 0, T + 1)[last + 1]` to 0, each `sd3_time_shift(shift, .)` (lines 9-10)."""
    n = int(max((transitions - last) * ratio, 1))
    post = np.linspace(np.linspace(1.0, 0.0, transitions + 1)[last + 1], 0.0, n)
    return (shift * post) / (1 + (shift - 1) * post)


# The window schedule of MixGRPO's release, Tencent-Hunyuan/MixGRPO at e5cdd6a. Each released
# script (scripts/finetune/finetune_flux_grpo_MixGRPO.sh, ..._MixGRPO_Flash.sh and
# ..._MixGRPO_Flash*.sh) sets sampling_steps=25 (line 54), iters_per_group (line 57),
# group_size=4 (line 58), sample_strategy="progressive" (line 59) and prog_overlap_step (line
# 60), and passes them with --prog_overlap (line 164) and --roll_back (line 168) to
# fastvideo/train_grpo_flux.py for --max_train_steps 300 (line 134). The training script
# builds GRPOTrainingStates(max_timesteps=sampling_steps - 2, cur_timestep=0, ...) (lines
# 915-928) and, every step, takes get_current_timesteps() and then calls update_iteration()
# (lines 945-947); its epoch loop (lines 931-937) runs 300 steps per epoch without stopping,
# the state carrying over. fastvideo/utils/grpo_states.py: update_iteration, "progressive"
# branch (lines 85-99), roll_back_start (lines 136-139), get_current_timesteps (lines 141-148).

MIXGRPO_RELEASE = "Tencent-Hunyuan/MixGRPO@e5cdd6a"

MIXGRPO_TRAIN_STEPS = 300
"""`--max_train_steps 300` (line 134 of each script)."""

MIXGRPO_SCRIPTS = {
    "MixGRPO": {  # finetune_flux_grpo_MixGRPO.sh lines 54-60, 164, 168
        "sampling_steps": 25,
        "group_size": 4,
        "iters_per_group": 25,
        "prog_overlap": True,
        "prog_overlap_step": 1,
        "roll_back": True,
    },
    "MixGRPO-Flash": {  # finetune_flux_grpo_MixGRPO_Flash.sh lines 54-60, 164, 168
        "sampling_steps": 25,
        "group_size": 4,
        "iters_per_group": 20,
        "prog_overlap": True,
        "prog_overlap_step": 1,
        "roll_back": True,
    },
    "MixGRPO-Flash*": {  # finetune_flux_grpo_MixGRPO_Flash*.sh lines 54-60, 164, 168
        "sampling_steps": 25,
        "group_size": 4,
        "iters_per_group": 20,
        "prog_overlap": True,
        "prog_overlap_step": 0,
        "roll_back": True,
    },
}
"""The window arguments of the three released scripts."""


def mixgrpo_windows(
    steps,
    sampling_steps,
    group_size,
    iters_per_group,
    prog_overlap,
    prog_overlap_step,
    roll_back,
):
    """The window of each of `steps` training steps, as MixGRPO's release steps
    `GRPOTrainingStates` with `sample_strategy="progressive"`: a list of `(first, count)`,
    the state's `cur_timestep` and the length of `get_current_timesteps()`, the transitions
    `first .. first + count - 1` that the step samples with noise and trains (`count` may be
    0: an empty window). Plain Python ints, the release's code read line by line."""
    max_timesteps = sampling_steps - 2  # train_grpo_flux.py line 919
    init_timestep = cur_timestep = 0  # line 920; grpo_states.py line 53
    cur_iter_in_group = 0  # train_grpo_flux.py line 921
    windows = []
    for _ in range(steps):
        # get_current_timesteps, grpo_states.py line 148
        current = list(range(cur_timestep, min(cur_timestep + group_size, max_timesteps)))
        windows.append((cur_timestep, len(current)))
        # update_iteration, lines 87-99
        cur_iter_in_group += 1
        if cur_iter_in_group >= iters_per_group:
            cur_iter_in_group = 0
            if prog_overlap:
                cur_timestep += prog_overlap_step
            else:
                cur_timestep += group_size
        if cur_timestep > max_timesteps:
            if roll_back:  # roll_back_start, lines 136-139
                cur_timestep = init_timestep
                cur_iter_in_group = 0
            else:
                cur_timestep = max_timesteps
    return windows


# ---------------------------------------------------------------------------------------------
# DGPO (docs/mathematics/dgpo.md §10), from the authors' release: github Luo-Yihong/DGPO at 01ceb4b,
# scripts/train_sd3_dgpo.py (cited below by line), with flow_grpo/ema.py and config/dgpo.py.

DGPO_RELEASE = "Luo-Yihong/DGPO@01ceb4b scripts/train_sd3_dgpo.py"


def unirl_sde_indices(num_timesteps, timestep_fraction, num_sde_steps, rollout_id):
    """UniRL's `AllSDEScheduler(num_timesteps, timestep_fraction, num_sde_steps)
    .get_sde_indices(rollout_id)` (`unirl/utils/scheduler_utils.py`), sorted as
    `resolve_sde_indices` returns them: the pool `int(T start) .. int(T end) - 1`, all of it
    when it holds no more than `num_sde_steps`, else `default_rng(rollout_id).choice`."""
    start, end = timestep_fraction
    pool = list(range(int(num_timesteps * start), int(num_timesteps * end)))
    if num_sde_steps >= len(pool):
        return pool
    chosen = np.random.default_rng(int(rollout_id)).choice(pool, size=num_sde_steps, replace=False)
    return sorted(int(i) for i in chosen)


def unirl_kl_sigma(sigmas, target_steps, eta, sigma_max=0.99):
    """UniRL's `FlowDPPO._compute_sigma_t` with `add_kl_coefficient=True`, in float64:
    `sqrt(s / (1 - min(s, 0.99))) eta sqrt(-(s_next - s))` per target step."""
    out = []
    for i in target_steps:
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        out.append(math.sqrt(s / (1.0 - min(s, sigma_max))) * eta * math.sqrt(-(s_next - s)))
    return np.asarray(out)


def sd3_time_shift(shift, t):
    """DanceGRPO's `sd3_time_shift` (`train_grpo_flux.py` lines 127-128)."""
    t = np.asarray(t, np.float64)
    return (shift * t) / (1 + (shift - 1) * t)


def dance_step(x, v, sigmas, index, eta):
    """DanceGRPO's `flux_step` with `sde_solver=True` (`train_grpo_flux.py` lines 131-153),
    in float64 and its order of operations: `(prev_sample_mean, std_dev_t,
    pred_original_sample)`."""
    x = np.asarray(x, np.float64)
    v = np.asarray(v, np.float64)
    sigma = float(sigmas[index])
    dsigma = float(sigmas[index + 1]) - sigma
    prev_sample_mean = x + dsigma * v
    pred_original_sample = x - sigma * v
    delta_t = sigma - float(sigmas[index + 1])
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(x - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    return prev_sample_mean, std_dev_t, pred_original_sample


def dance_log_prob(prev_sample, prev_sample_mean, std_dev_t):
    """`flux_step`'s log density (lines 159-167): the mean over coordinates of
    `-(x - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)`."""
    r = np.asarray(prev_sample, np.float64) - np.asarray(prev_sample_mean, np.float64)
    per = -(r**2) / (2 * std_dev_t**2) - math.log(std_dev_t) - math.log(math.sqrt(2 * math.pi))
    return float(np.mean(per))


def dancegrpo_loss(log_ratio, advantages, weights, kept, clip_range, adv_clip_max):
    """DanceGRPO's loss (`train_grpo_flux.py` lines 589-603; with several rewards
    `train_grpo_hunyuan.py` lines 455-477): each kept transition's
    `sum_k w_k max(-A_k r, -A_k clip(r, 1 - eps, 1 + eps))`, `A_k` each reward's advantage
    clipped to `adv_clip_max`; the release averages them over its rows and
    `train_timesteps` (the kept set). Returns `(total, count)`."""
    log_ratio = np.asarray(log_ratio, np.float64)
    a = np.asarray(advantages, np.float64)
    total, count = 0.0, 0
    for i in range(log_ratio.shape[0]):
        for j in range(log_ratio.shape[1]):
            if not kept[i, j]:
                continue
            count += 1
            ratio = math.exp(log_ratio[i, j])
            clipped = min(max(ratio, 1.0 - clip_range), 1.0 + clip_range)
            for k, weight in enumerate(weights):
                advantage = min(max(a[i, k], -adv_clip_max), adv_clip_max)
                total += weight * max(-advantage * ratio, -advantage * clipped)
    return total, count


def dgpo_rollout_sigmas(num_steps, flow_shift=3.0):
    """The start times of the release's rollout (lines 557-559: diffusers'
    `DPMSolverMultistepScheduler` with `use_flow_sigmas` and `flow_shift` 3):
    `s = 1 - linspace(1, 1/1000, n + 1)`, shifted `shift s / (1 + (shift - 1) s)`, reversed,
    the last dropped."""
    sigmas = 1.0 - np.linspace(1.0, 1.0 / 1000, num_steps + 1)
    return np.flip(flow_shift * sigmas / (1 + (flow_shift - 1) * sigmas))[:-1].copy()


def dgpo_time(sigma):
    """Lines 852-854 and 1099-1100: the rollout records the scheduler's `timesteps`, which
    `set_timesteps` casts from `sigma * 1000` to int64 (truncating), and training noises at
    `t / 1000`."""
    return np.trunc(np.asarray(sigma, np.float64) * 1000).astype(np.int64) / 1000


def dgpo_index_choices(trunc_steps):
    """Lines 1062-1064: each inner epoch draws `random.sample(train_timesteps, M)`, distinct
    indices of `train_timesteps = range(trunc_steps + 1)`, shared by all its batches."""
    return set(range(trunc_steps + 1))


def dgpo_error(v, target):
    """Lines 171, 173, 1132 and 1134: `(target - v)^2` averaged per example, `target = eps -
    x_0` (line 1107)."""
    v = np.asarray(v, np.float64)
    return np.mean((np.asarray(target, np.float64) - v).reshape(v.shape[0], -1) ** 2, axis=1)


def dgpo_advantages(advantages, adv_clip_max):
    """Lines 1127-1131: `clamp(A, -adv_clip_max, adv_clip_max)`."""
    return np.clip(np.asarray(advantages, np.float64), -adv_clip_max, adv_clip_max)


def dgpo_should_clip(error, old_error, advantages, clip_range):
    """Lines 1136-1142: `ratio = exp(-e + e_old)`; clipped where `A > 0` and
    `ratio > 1 + c`, or `A <= 0` and `ratio < 1 - c` (then line 1144 detaches `e`)."""
    ratio = np.exp(-np.asarray(error, np.float64) + np.asarray(old_error, np.float64))
    a = np.asarray(advantages, np.float64)
    return np.where(a > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_group_weights(advantages, error, reference_error, group, beta_dpo, group_size):
    """Lines 175-189: `A beta (e - e_ref) / group_size` summed over each group's rows
    (`scatter_add_` over the prompt groups, all-reduced), then `sigmoid`; one weight per
    row, its group's."""
    a = np.asarray(advantages, np.float64)
    term = a * beta_dpo * (np.asarray(error) - np.asarray(reference_error)) / group_size
    group = np.asarray(group)
    sums = np.array([term[group == g].sum() for g in group])
    return np.exp(-np.logaddexp(0.0, -sums))  # sigmoid, without overflow


def dgpo_policy_loss(weights, advantages, error):
    """Line 191: `(w A e).mean()`, the weight detached (a constant here)."""
    return float(np.mean(np.asarray(weights) * np.asarray(advantages) * np.asarray(error)))


def dgpo_group_dpo(advantages, error, reference_error, group, beta_dpo, group_size):
    """The group DPO loss whose gradient lines 162-193 compute ("the gradient-equivalent
    version", line 166): the README's `-log sigmoid(R(G+) - R(G-))` per group,
    `softplus(x_g)` with `x_g = beta sum_g A (e - e_ref) / group_size`, over `beta`, each
    group counting `group_size` rows, over the rows: its gradient is `mean(sigmoid(x_g) A
    grad e)`."""
    a = np.asarray(advantages, np.float64)
    term = a * beta_dpo * (np.asarray(error) - np.asarray(reference_error)) / group_size
    group = np.asarray(group)
    total = sum(np.logaddexp(0.0, term[group == g].sum()) for g in np.unique(group))
    return float(total * group_size / beta_dpo / len(a))


def dgpo_kl(v, v_reference):
    """Lines 1151 and 1154: `(v - v_ref)^2` averaged per example (then over the batch)."""
    v = np.asarray(v, np.float64)
    return np.mean((v - np.asarray(v_reference, np.float64)).reshape(v.shape[0], -1) ** 2, axis=1)


def dgpo_ema_decay(global_step):
    """Line 1176: `min(0.3, 0.001 global_step)`, `global_step` the updates before this one."""
    return min(0.3, 0.001 * global_step)


def dgpo_ema_update(ema, live, decay):
    """flow_grpo/ema.py lines 32-43 (`step` with `decay`): `ema += (1 - decay) (live - ema)`."""
    ema = np.asarray(ema, np.float64)
    return ema + (1.0 - decay) * (np.asarray(live, np.float64) - ema)


def dgpo_samples_with_ema(global_step, switch_ema_ref):
    """Lines 799-800: the rollout samples with the EMA reference when
    `global_step > switch_ema_ref`."""
    return global_step > switch_ema_ref


# ---------------------------------------------------------------------------------------------
# Flow-DPPO (docs/mathematics/dppo.md §12), from the authors' release: github
# Tencent-Hunyuan/UniRL at 1a7b501, unirl/algorithms/flowdppo.py (cited below by line;
# verl-omni's `FlowDPPOLoss`, verl_omni/trainer/diffusion/diffusion_algos.py lines 375-443,
# computes the same).

DPPO_RELEASE = "Tencent-Hunyuan/UniRL@1a7b501 unirl/algorithms/flowdppo.py"


def dppo_kl(mean, old_mean, sigma):
    """`_gaussian_kl_div` (lines 43-51) reduced by line 93: `(mu - mu_old)^2 / (2 sigma_t^2)`
    averaged over the latent coordinates (not summed); `sigma_t` from `_compute_sigma_t`
    (lines 342-368: `unirl_kl_sigma`, or 1 without `add_kl_coefficient`, lines 353-354)."""
    d = np.asarray(mean, np.float64) - np.asarray(old_mean, np.float64)
    return float(np.mean(d**2 / (2 * float(sigma) ** 2)))


def dppo_dropped(kl, ratio, advantage, threshold):
    """Lines 96-107: `kl_mask = kl < threshold` keeps; of the rest, `pos_rm` where `ratio > 1`
    and `A > 0`, `neg_rm` where `ratio < 1` and `A < 0`, are removed. Elementwise, in
    float64."""
    kl = np.asarray(kl, np.float64)
    ratio = np.asarray(ratio, np.float64)
    a = np.asarray(advantage, np.float64)
    high = ~(kl < threshold)
    return high & (((ratio > 1.0) & (a > 0)) | ((ratio < 1.0) & (a < 0)))


def dppo_loss(log_ratio, kl, advantages, kept, threshold):
    """Lines 86-89, 109-111 and 319, term by term: `ratio = exp(log_ratio)`, the term
    `-A ratio` (no clip), 0 where `dppo_dropped`; the loss is the mean over every trained
    (kept) transition, dropped ones included. `[N, K]` inputs; returns `(total, count,
    dropped)`."""
    log_ratio = np.asarray(log_ratio, np.float64)
    n, k = log_ratio.shape
    a = np.asarray(advantages, np.float64)
    if a.ndim == 1:
        a = np.repeat(a[:, None], k, axis=1)
    total, count = 0.0, 0
    dropped = np.zeros((n, k), bool)
    for i in range(n):
        for j in range(k):
            if not kept[i, j]:
                continue
            count += 1
            ratio = math.exp(log_ratio[i, j])
            dropped[i, j] = bool(dppo_dropped(kl[i, j], ratio, a[i, j], threshold))
            if not dropped[i, j]:
                total += -a[i, j] * ratio
    return total, count, dropped


def central_differences(loss, params, eps=1e-6):
    """The gradient of the float64 scalar `loss(params)` in each array of the list `params`,
    by central differences of step `eps`: one array per parameter, of its shape."""
    gradients = []
    for which, array in enumerate(params):
        numeric = np.zeros(array.shape)
        for index in np.ndindex(array.shape):
            up = [p.copy() for p in params]
            down = [p.copy() for p in params]
            up[which][index] += eps
            down[which][index] -= eps
            numeric[index] = (loss(up) - loss(down)) / (2 * eps)
        gradients.append(numeric)
    return gradients


def attention(q, k, v):
    """Softmax attention of one example, heads apart: `q` `[S, H, d]`, `k` and `v`
    `[K, H, d]`; `softmax(q k^T / sqrt(d)) v` per head, `[S, H, d]`."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("shd,khd->hsk", q, k) / math.sqrt(q.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hsk,khd->shd", weights, v)


def attention_vjp(q, k, v, d_out):
    """The gradients of `sum(attention(q, k, v) * d_out)` in `q`, `k` and `v`, by the chain
    rule written out: with `P` the softmax weights, `dV = P^T dO`, `dP = dO V^T`,
    `dS = P (dP - rowsum(P dP))`, `dQ = dS K / sqrt(d)`, `dK = dS^T Q / sqrt(d)`."""
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    scale = 1 / math.sqrt(q.shape[-1])
    scores = np.einsum("shd,khd->hsk", q, k) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    d_v = np.einsum("hsk,shd->khd", weights, d_out)
    d_weights = np.einsum("shd,khd->hsk", d_out, v)
    d_scores = weights * (d_weights - np.sum(weights * d_weights, axis=-1, keepdims=True))
    d_q = np.einsum("hsk,khd->shd", d_scores, k) * scale
    d_k = np.einsum("hsk,shd->khd", d_scores, q) * scale
    return d_q, d_k, d_v
