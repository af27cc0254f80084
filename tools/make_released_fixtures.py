"""Fixtures from the released code of DanceGRPO and of UniRL's Flow-DPPO, run on the CPU.

`tests/test_dancegrpo.py` and `tests/test_dppo_released.py` compare the library with what
these functions and lines compute; the tests need no torch. This runs by hand in a venv with
torch and NumPy (torch 2.13.0 CPU, NumPy 2.4.6), on checkouts of the three sources at the
commits below (the pull request's head for UniRL's open fix):

    git clone https://github.com/XueZeyue/DanceGRPO && git -C DanceGRPO checkout 15cc71d
    git clone https://github.com/Tencent-Hunyuan/UniRL && git -C UniRL checkout 1a7b501
    git -C UniRL fetch origin pull/38/head && git -C UniRL worktree add ../UniRL-38 FETCH_HEAD
    /tmp/venv-torch/bin/python tools/make_released_fixtures.py DanceGRPO UniRL UniRL-38

Nothing of the releases is copied here: each function is found by name in its file (`ast`)
and each piece of inline code by the names it assigns, then executed as written, with the
modules it uses (`torch`, `math`, `numpy`) and stubs for what lies outside it (a row's
`sample`, `args`). It writes `tests/data/released/`:

- `dancegrpo.npz`, from `fastvideo/train_grpo_flux.py`: `sigmas`, `sd3_time_shift(3,
    linspace(1, 0, 17))`; for each step index `i` of 16, `flux_step(v, x, 0.3, sigmas, i,
    prev_sample, grpo=True, sde_solver=True)` on random float32 `x`, `v`, `prev_sample`
    (`[3, 2, 4, 4]`): `log_prob`, `pred_original`, and `flux_step(..., grpo=False)`'s
    `prev_sample_mean`; the group advantages of `train_one_step` (the `use_group` branch) of
    `rewards` in groups of 4; the clipped loss of its inner loop (one row at a time, as the
    release's `sample`s are rows, with `gradient_accumulation_steps` and `train_timesteps` 1)
    on `new_log_probs`, `old_log_probs` and `advantages` of 8 rows; and from
    `train_grpo_hunyuan.py` the two-reward loss (`vq`, `mq`, with `vq_coef` 1 and `mq_coef`
    0.5) of the same rows.
- `flowdppo.npz`, from UniRL: `sde_indices` of `AllSDEScheduler(10, [0.0, 0.5], 3)` for
    rollouts 0 .. 199 (`unirl/utils/scheduler_utils.py`); `FlowDPPO._compute_sigma_t` on
    SD3's grid of 10 steps (shift 3, eta 0.7) at the released commit (`sigma_t`) and at the
    pull request (`sigma_t_pr38`); `_flowdppo_kl_adv_loss` (`unirl/algorithms/flowdppo.py`)
    on random means, log densities and advantages (`loss_per_elem` and its metrics); and
    `RolloutTrack.compute_advantages(use_global_std=True)` (`unirl/types/rollout_resp.py`)
    of `rewards` in groups of 4.
"""

import __future__

import ast
import importlib.util
import math
import pathlib
import sys
import types
import typing

import numpy as np
import torch


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "released"
FUTURE = __future__.annotations.compiler_flag


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _function(path: pathlib.Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    """The definition of `name` (a method of `cls` when given) in `path`."""
    body = _tree(path).body
    if cls is not None:
        (klass,) = [node for node in body if isinstance(node, ast.ClassDef) and node.name == cls]
        body = klass.body
    (found,) = [node for node in body if isinstance(node, ast.FunctionDef) and node.name == name]
    return found


def _define(path: pathlib.Path, namespace: dict, *names: str, cls: str | None = None) -> dict:
    """Execute the definitions of `names` from `path` in `namespace`."""
    module = ast.Module(body=[_function(path, name, cls) for name in names], type_ignores=[])
    exec(compile(module, str(path), "exec", flags=FUTURE), namespace)
    return namespace


def _assigned(node: ast.stmt) -> set[str]:
    """The names a statement assigns (its targets' root names)."""
    names = set()
    targets = node.targets if isinstance(node, ast.Assign) else []
    for target in targets:
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value
        if isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _inline(
    path: pathlib.Path, function: str, first: str, last: str, given: frozenset[str] = frozenset()
) -> ast.Module:
    """The statements of `function` from the one assigning `first` to the one assigning
    `last`, in the innermost block holding both, less those assigning a name in `given` (the
    caller provides it: the model's log densities)."""
    for node in ast.walk(_function(path, function)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        starts = [i for i, s in enumerate(body) if first in _assigned(s)]
        ends = [i for i, s in enumerate(body) if last in _assigned(s)]
        if starts and ends and starts[0] <= ends[-1]:
            chosen = [s for s in body[starts[0] : ends[-1] + 1] if not _assigned(s) & given]
            return ast.Module(body=chosen, type_ignores=[])
    raise LookupError(f"{function}: no block assigns {first} .. {last} in {path}")


def _run_inline(module: ast.Module, path: pathlib.Path, namespace: dict) -> dict:
    exec(compile(module, str(path), "exec"), namespace)
    return namespace


def dancegrpo(root: pathlib.Path) -> dict[str, np.ndarray]:
    flux = root / "fastvideo" / "train_grpo_flux.py"
    hunyuan = root / "fastvideo" / "train_grpo_hunyuan.py"
    namespace = _define(flux, {"torch": torch, "math": math}, "sd3_time_shift", "flux_step")
    sigmas = namespace["sd3_time_shift"](3, torch.linspace(1, 0, 17))
    generator = torch.Generator().manual_seed(0)
    shape = (16, 3, 2, 4, 4)
    x = torch.randn(shape, generator=generator)
    v = torch.randn(shape, generator=generator)
    prev = x + 0.3 * torch.randn(shape, generator=generator)
    log_probs, means, originals = [], [], []
    for i in range(16):
        _, original, log_prob = namespace["flux_step"](
            v[i], x[i], 0.3, sigmas, i, prev_sample=prev[i], grpo=True, sde_solver=True
        )
        mean, _ = namespace["flux_step"](
            v[i], x[i], 0.3, sigmas, i, prev_sample=None, grpo=False, sde_solver=True
        )
        log_probs.append(log_prob)
        means.append(mean)
        originals.append(original)
    out = {
        "sigmas": sigmas.numpy(),
        "x": x.numpy(),
        "v": v.numpy(),
        "prev_sample": prev.numpy(),
        "log_prob": torch.stack(log_probs).numpy(),
        "prev_sample_mean": torch.stack(means).numpy(),
        "pred_original": torch.stack(originals).numpy(),
    }

    # The group advantages: the `use_group` branch of `train_one_step`.
    rewards = torch.randn(12, generator=generator) * 0.3 + 1.0
    rewards[4:8] = 0.25  # a constant group
    args = types.SimpleNamespace(num_generations=4, use_group=True)
    scope = {"torch": torch, "args": args, "samples": {"rewards": rewards}}
    _run_inline(_inline(flux, "train_one_step", "n", "samples"), flux, scope)
    out["rewards"] = rewards.numpy()
    out["advantages"] = scope["samples"]["advantages"].numpy()

    # The clipped loss of one transition, row by row (each `sample` is one row).
    rows = 8
    new_log_probs = torch.randn(rows, generator=generator) * 1e-4 - 1.0
    old_log_probs = new_log_probs + torch.randn(rows, generator=generator) * 2e-4
    vq = torch.randn(rows, generator=generator) * 2.0
    vq[0] = 7.0  # beyond the advantage clip
    mq = torch.randn(rows, generator=generator) * 2.0
    given = frozenset({"new_log_probs"})
    flux_loss = _inline(flux, "train_one_step", "clip_range", "loss", given)
    hunyuan_loss = _inline(hunyuan, "train_one_step", "clip_range", "final_loss", given)
    settings = types.SimpleNamespace(
        clip_range=1e-4, adv_clip_max=5.0, gradient_accumulation_steps=1, vq_coef=1.0, mq_coef=0.5
    )
    single, multi = [], []
    for row in range(rows):
        sample = {
            "advantages": vq[row : row + 1],
            "vq_advantages": vq[row : row + 1],
            "mq_advantages": mq[row : row + 1],
            "log_probs": old_log_probs[row : row + 1, None],
        }
        common = {
            "torch": torch,
            "args": settings,
            "sample": sample,
            "new_log_probs": new_log_probs[row : row + 1],
            "train_timesteps": 1,
            "_": 0,
        }
        single.append(_run_inline(flux_loss, flux, dict(common))["loss"])
        multi.append(_run_inline(hunyuan_loss, hunyuan, dict(common))["final_loss"])
    out.update(
        new_log_probs=new_log_probs.numpy(),
        old_log_probs=old_log_probs.numpy(),
        vq_advantages=vq.numpy(),
        mq_advantages=mq.numpy(),
        loss=torch.stack(single).numpy(),
        multi_reward_loss=torch.stack(multi).numpy(),
    )
    return out


def flowdppo(root: pathlib.Path, pr38: pathlib.Path) -> dict[str, np.ndarray]:
    scheduler_path = root / "unirl" / "utils" / "scheduler_utils.py"
    spec = importlib.util.spec_from_file_location("released_scheduler_utils", scheduler_path)
    assert spec is not None and spec.loader is not None
    scheduler = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = scheduler
    spec.loader.exec_module(scheduler)
    drawn = scheduler.AllSDEScheduler(10, [0.0, 0.5], 3)
    indices = np.array([sorted(drawn.get_sde_indices(r)) for r in range(200)], np.int64)

    algorithm = root / "unirl" / "algorithms" / "flowdppo.py"
    names = {"torch": torch, **{name: getattr(typing, name) for name in typing.__all__}}
    namespace = _define(algorithm, dict(names), "_gaussian_kl_div", "_flowdppo_kl_adv_loss")
    sigma_t = _define(algorithm, dict(names), "_compute_sigma_t", cls="FlowDPPO")
    sigmas = torch.linspace(1, 0, 11)
    sigmas = 3.0 * sigmas / (1 + 2.0 * sigmas)
    segment = types.SimpleNamespace(sigmas=sigmas)
    released_self = types.SimpleNamespace(
        add_kl_coefficient=True, params=types.SimpleNamespace(eta=0.7)
    )
    steps = list(range(10))
    released = sigma_t["_compute_sigma_t"](released_self, segment, steps, torch.device("cpu"))

    kernels = pr38 / "unirl" / "sde" / "kernels.py"
    strategy_methods = _define(
        kernels, {"torch": torch, "math": math}, "_std_dev_t", cls="FlowSDEStrategy"
    )
    base = _define(kernels, {"torch": torch, "math": math}, "transition_std", cls="SDEStrategy")
    strategy = types.SimpleNamespace()
    strategy._std_dev_t = lambda **kw: strategy_methods["_std_dev_t"](strategy, **kw)
    strategy.transition_std = lambda **kw: base["transition_std"](strategy, **kw)
    fixed_self = types.SimpleNamespace(
        add_kl_coefficient=True,
        params=types.SimpleNamespace(eta=0.7),
        stage=types.SimpleNamespace(strategy=strategy),
    )
    fixed_sigma = _define(pr38 / "unirl" / "algorithms" / "flowdppo.py", dict(names),
                          "_compute_sigma_t", cls="FlowDPPO")  # fmt: skip
    fixed = fixed_sigma["_compute_sigma_t"](fixed_self, segment, steps, torch.device("cpu"))

    generator = torch.Generator().manual_seed(1)
    batch, trained, latent = 6, 3, (2, 3, 3)
    old_means = torch.randn(batch, trained, *latent, generator=generator)
    new_means = old_means + 0.004 * torch.randn(batch, trained, *latent, generator=generator)
    old_logp = torch.randn(batch, trained, generator=generator) * 0.3 - 1.0
    new_logp = old_logp + 0.05 * torch.randn(batch, trained, generator=generator)
    advantages = (torch.randn(batch, generator=generator) * 2.0)[:, None].expand(batch, trained)
    kl_sigma = released[:, :trained]
    loss_per_elem, metrics = namespace["_flowdppo_kl_adv_loss"](
        new_logp=new_logp,
        old_logp=old_logp,
        new_means=new_means,
        old_means=old_means,
        advantages=advantages,
        sigma_t=kl_sigma,
        kl_mask_threshold=1e-5,
    )

    rollout = root / "unirl" / "types" / "rollout_resp.py"
    stubs = {"torch": torch, "_hydrate_tensor_meta": lambda value: value,
             "_track_with_field": lambda track, name, value: value, **names}  # fmt: skip
    track = _define(rollout, stubs, "compute_advantages", cls="RolloutTrack")
    rewards = torch.randn(16, generator=generator) * 0.5
    rewards[4:8] = 1.0  # a constant group
    groups = [f"p{i // 4}" for i in range(16)]
    owner = types.SimpleNamespace(
        rewards=rewards, sample_ids=[f"s{i}" for i in range(16)], parent_ids=groups
    )
    global_std = track["compute_advantages"](owner, use_global_std=True)
    return {
        "sde_indices": indices,
        "sigmas": sigmas.numpy(),
        "sigma_t": released.reshape(-1).numpy(),
        "sigma_t_pr38": fixed.reshape(-1).numpy(),
        "old_means": old_means.numpy(),
        "new_means": new_means.numpy(),
        "old_logp": old_logp.numpy(),
        "new_logp": new_logp.numpy(),
        "dppo_advantages": advantages.numpy(),
        "kl_sigma": kl_sigma.reshape(-1).numpy(),
        "loss_per_elem": loss_per_elem.numpy(),
        **{f"metric_{name}": value.numpy() for name, value in metrics.items()},
        "rewards": rewards.numpy(),
        "global_std_advantages": global_std.numpy(),
    }


def main(argv: list[str]) -> int:
    dance_root, unirl_root, pr38_root = (pathlib.Path(arg) for arg in argv)
    OUT.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        np.savez_compressed(OUT / "dancegrpo.npz", **dancegrpo(dance_root))
        np.savez_compressed(OUT / "flowdppo.npz", **flowdppo(unirl_root, pr38_root))
    print(f"wrote {OUT / 'dancegrpo.npz'} and {OUT / 'flowdppo.npz'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
