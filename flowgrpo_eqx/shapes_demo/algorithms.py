"""The RL algorithms the main job can fine-tune with: one final class each, chosen by name
from `ALGORITHMS` (the `algorithm` setting).

An algorithm checks the settings that must fit it, builds the objective the trainer trains
and the rollout that feeds it, and says whether that objective trains on a policy ratio. It
reads the job's settings through `Settings`, a protocol that `config.JobConfig` satisfies (so
that the configuration can check itself through `ALGORITHMS` without importing what imports
it), and what it builds from as `JobPieces`, which `parts.ShapesJob.pieces()` hands over.
Those, the interface `AbstractAlgorithm` and the pieces the algorithms build with live in
`algorithm_base`, and are importable from here too.
"""

from typing import Any, ClassVar, final

import equinox as eqx

from .. import (
    AbstractSolver,
    AdvantageStd,
    AWMObjective,
    DanceGRPOObjective,
    DanceSampler,
    DanceSDE,
    DGPOObjective,
    DiffusionNFTObjective,
    DPMSolverPP2M,
    Euler,
    FlowDPPOObjective,
    FlowGRPOObjective,
    FlowSDE,
    GuidedFlow,
    Heun,
    MixSampler,
    ModelTime,
    ODESampler,
    RampedDecay,
    RectifiedFlow,
    SDESampler,
)
from .algorithm_base import (
    ALGORITHM_SETTINGS as ALGORITHM_SETTINGS,
    CLIPS,
    DPPO_KL_STDS as DPPO_KL_STDS,
    RATIO,
    RECORDED_WINDOW,
    SDE_ROLLOUT,
    AbstractAlgorithm as AbstractAlgorithm,
    JobPieces as JobPieces,
    Settings as Settings,
    dppo_steps as dppo_steps,
    flow_grpo_objective as flow_grpo_objective,
    job_flow as job_flow,
    refuse_shared_noise,
    rollout_sde as rollout_sde,
    sde_window as sde_window,
    window_sampler as window_sampler,
    window_schedule as window_schedule,
)
from .settings import (
    AlgorithmName,
)


@final
class FlowGRPO(AbstractAlgorithm):
    """Flow-GRPO: the clipped policy gradient on SDE transitions the rollout records."""

    reads: ClassVar[frozenset[str]] = CLIPS | {"grpo_guard"} | RATIO | SDE_ROLLOUT | RECORDED_WINDOW
    trains_on_ratios: ClassVar[bool] = True

    def check(self, config: Settings) -> None:
        del config

    def default_settings(self) -> dict[str, Any]:
        return {}

    def objective(self, job: JobPieces, base: Any) -> FlowGRPOObjective:
        return self.flow_grpo_objective(job, base)

    advantage_std: ClassVar[AdvantageStd] = "group"

    def sampler(self, job: JobPieces) -> SDESampler:
        """The job's SDE, recording the trained window (`window_sampler`), and the means
        GRPO-Guard reads."""
        return window_sampler(job.config.rollout, record_means=job.config.objective.grpo_guard)


@final
class NFT(AbstractAlgorithm):
    """DiffusionNFT: negative-aware flow matching on final samples of a deterministic
    rollout, as released."""

    reads: ClassVar[frozenset[str]] = frozenset({"nft_beta", "nft_old_decay", "adv_clip_max"})
    trains_on_ratios: ClassVar[bool] = False

    def check(self, config: Settings) -> None:
        refuse_shared_noise(config, "nft")
        if config.objective.beta > 0:
            raise ValueError(
                "Setting `beta` (Flow-GRPO's KL weight) must be 0 with algorithm 'nft', got "
                f"{config.objective.beta!r}."
            )

    def default_settings(self) -> dict[str, Any]:
        """No shared initial noise: a deterministic rollout would repeat one sample."""
        return {"shared_noise": False}

    def objective(self, job: JobPieces, base: Any) -> DiffusionNFTObjective:
        """DiffusionNFT's objective as released: `adv_clip_max` is its `A_max`, no guidance,
        and its old policy follows the live one once per epoch by the released ramp
        `min(0.001 step, nft_old_decay)` over the optimizer steps done."""
        config = job.config
        return DiffusionNFTObjective(
            job_flow(job, guidance=None),
            beta=config.objective.nft_beta,
            adv_max=config.objective.adv_clip_max,
            old_decay=RampedDecay(maximum=config.objective.nft_old_decay),
            pretrained=base,
        )

    advantage_std: ClassVar[AdvantageStd] = "global"

    def sampler(self, job: JobPieces) -> ODESampler:
        """The deterministic second-order `Heun` solver, as released."""
        return ODESampler(Heun())


@final
class AWM(AbstractAlgorithm):
    """Advantage Weighted Matching as released (`AWMObjective`'s defaults: the GenEval recipe
    of `config/dgx_awm.py`), adapted to this task where it cannot be taken as it is:

    - The KL weight to the base model is the `beta` setting, 0.001 by default (the
        release's); `clip_range` (1.0 by default, the release's) and `adv_clip_max` (5, the
        release's) are the shared settings.
    - No guidance in the rollout or the loss (the release trains with CFG off), whatever
        `guidance_scale`; advantages over the global reward std (`global_std=True`); no
        shared initial noise (each sample draws its own).
    - The rollout samples the job's SDE (`rollout_sde`) with `noise_level` 0.4 by default:
        this library has no SA-Solver, the release's stochastic sampler (stochasticity 0.4
        on `0.3 <= t <= 0.9`), and the job's grid of `rollout_steps - 1` start times (5 by
        default) is too coarse for that window.
    - `train_timesteps` is `min(6, int(0.9 K) - 1)` for `K` start times: the released
        6 strata of `[1, int(0.9 K))` would draw the same index several times on a grid of 5
        (14 in the release), so each available index is trained once instead (3 of 5).
    - The optimizer, learning rate and updates per epoch are the job's: the release's
        LoRA at 3e-4 with one accumulated update per epoch is for SD3.5-M.
    """

    reads: ClassVar[frozenset[str]] = CLIPS | SDE_ROLLOUT | {"window_schedule"}
    trains_on_ratios: ClassVar[bool] = False

    def check(self, config: Settings) -> None:
        if config.rollout.rollout_steps < 4:
            raise ValueError(
                "Setting `rollout_steps` must be at least 4 with algorithm 'awm': its strata "
                "of the grid skip the first start time and the last tenth, got "
                f"{config.rollout.rollout_steps!r}."
            )

    def default_settings(self) -> dict[str, Any]:
        """The release's KL weight, clip range, SDE noise, and independent initial noise."""
        return {"beta": 0.001, "clip_range": 1.0, "noise_level": 0.4, "shared_noise": False}

    def objective(self, job: JobPieces, base: Any) -> AWMObjective:
        """AWM's objective as released, its KL weight `beta` and clips the job's."""
        config = job.config
        start_times = config.rollout.rollout_steps - 1
        return AWMObjective(
            job_flow(job, guidance=None),
            kl_beta=config.objective.beta,
            clip_range=config.objective.clip_range,
            adv_clip_max=config.objective.adv_clip_max,
            train_timesteps=max(1, min(6, int(0.9 * start_times) - 1)),
            sde=rollout_sde(config.rollout),
            pretrained=base,
        )

    advantage_std: ClassVar[AdvantageStd] = "global"

    def sampler(self, job: JobPieces) -> SDESampler:
        """The job's SDE (`rollout_sde`)."""
        return SDESampler(rollout_sde(job.config.rollout))


@final
class DGPO(AbstractAlgorithm):
    """Direct Group Preference Optimization as released (`DGPOObjective`'s defaults: the
    default recipe of `config/dgpo.py`, `general_ocr_sd3_4gpu`), adapted to this task where
    it cannot be taken as it is:

    - The KL weight to the base model is the `beta` setting, 0.02 by default (the
        recipe's); the DSM clip is `clip_range`, 0.01 by default (the recipe's), and
        `adv_clip_max` (5, the release's) the advantage clip.
    - The rollout is the deterministic DPM-Solver++(2M) (`ODESampler(DPMSolverPP2M())`,
        the release's scheduler) with the job's guidance (the release samples with CFG 4.5
        and trains without; the loss never guides here either); advantages over the global
        reward std (`global_std=True`); no shared initial noise, which would make every
        sample of a group the same with a deterministic solver.
    - `group_size` is the job's `groups`; one update per epoch on the whole rollout
        (`minibatch_rows` none, the release's recipe), unless `minibatch_rows` is named (the
        tiny preset names 4): each group's preference then sums over its rows in the
        minibatch.
    - `trunc_steps` is `int(0.7 K) - 1` for `K` start times (the release trains the first 7
        of its 10, `trunc_steps=6`), at least 0, and `train_timesteps` `min(4, trunc_steps +
        1)` (4, the release's, where the grid allows).
    - The optimizer, learning rate and EMA switch (200 updates) are the job's and the
        release's: the release's LoRA at 3e-4 is for SD3.5-M.
    """

    reads: ClassVar[frozenset[str]] = CLIPS
    trains_on_ratios: ClassVar[bool] = False

    def check(self, config: Settings) -> None:
        refuse_shared_noise(config, "dgpo")

    def default_settings(self) -> dict[str, Any]:
        """The release's KL weight and DSM clip, independent initial noise, and one update
        per epoch."""
        return {"beta": 0.02, "clip_range": 0.01, "shared_noise": False, "minibatch_rows": None}

    def objective(self, job: JobPieces, base: Any) -> DGPOObjective:
        """DGPO's objective as released, its group the job's `groups`, its KL weight `beta`
        and clips the job's; the trained indices scaled to the job's grid."""
        config = job.config
        trunc_steps = max(0, int(0.7 * (config.rollout.rollout_steps - 1)) - 1)
        return DGPOObjective(
            job_flow(job, guidance=job.guidance),
            group_size=config.rollout.groups,
            kl_beta=config.objective.beta,
            clip_range=config.objective.clip_range,
            adv_clip_max=config.objective.adv_clip_max,
            trunc_steps=trunc_steps,
            train_timesteps=min(4, trunc_steps + 1),
            pretrained=base,
        )

    advantage_std: ClassVar[AdvantageStd] = "global"

    def sampler(self, job: JobPieces) -> ODESampler:
        """The deterministic DPM-Solver++(2M), as released."""
        return ODESampler(DPMSolverPP2M())


@final
class MixGRPO(AbstractAlgorithm):
    """MixGRPO, MixGRPO-Flash and MixGRPO-Flash* (github `Tencent-Hunyuan/MixGRPO`,
    `scripts/finetune/finetune_flux_grpo_MixGRPO.sh`, `..._MixGRPO_Flash.sh`,
    `..._MixGRPO_Flash*.sh`): Flow-GRPO's objective, as the job's `flow_grpo` builds it,
    trained on the transitions of a window of `sde_steps` stochastic steps that moves along
    the grid (`MixSampler`); Euler ODE steps before the window, and after it `solver` on the
    rest of the grid, compressed by `compress_ratio` for Flash and Flash*.

    As released (`docs/mathematics/mixgrpo.md` §11): the window is the release's progressive one
    (`ProgressiveWindow`): it moves one transition later (`window_stride`: the scripts'
    `prog_overlap` with `prog_overlap_step` 1; 0 for Flash*, whose window never moves) every
    `shift_every` epochs (`iters_per_group`: 25, and 20 for Flash and Flash*; one iteration
    of the release is one rollout and its update, an epoch here, so epoch `e` is the
    release's step `e - 1` and the job's 300 epochs are the scripts' 300 steps), never
    reaches the grid's last two transitions (`max_timesteps = T - 2`), is cut short before
    them, holds none at its last position and then starts again from the first transition
    (`roll_back`); the model receives `floor(1000 t) / 1000` (`model_time="thousandths"`);
    Flash runs DPM-Solver++(2M) after the window on a grid compressed by 0.4, Flash* by 0.2.
    Adapted to this task:

    - The window is the job's `sde_steps` (2) transitions, all trained, on the job's grid
        (6 points): the release's 4 of 25 with `timestep_fraction` 0.6 is for FLUX.1 at 25
        steps. On 5 transitions the window's positions are then 0 and 1 (whole), 2 (cut to
        transition 2) and 3 (empty: a rollout of ODE steps whose batch trains nothing, the
        loss 0 with zero gradients, while AdamW still steps), 25 epochs each, three times
        over the 300 epochs. The release's 300 steps on 25 transitions never reach its cut
        or empty windows (its starts go from 0 to 11, Flash's to 14).
    - Flash samples on the release's 25 transitions (26 points, `rollout_steps`), so that
        the compressed rest keeps the release's number of solver steps: the window's last
        stochastic transition `l` leaves `int(max(0.4 (25 - l), 1))` points after it, 9 to
        4 over the 300 epochs (the release's 8 to 3). On a shorter grid the rest shrinks to
        one solver step, or none (the sample decoded short of t = 0), and the policy
        collapses (`docs/recipes.md`).
    - Flash* samples on 23 points: its fixed window (transitions 0 and 1) then leaves
        `int(0.2 x 21) = 4` points after it, as the release's leaves 4 after its 4 of 25.
    - The objective, its clip, KL and step size are the job's Flow-GRPO defaults (the
        release's clip 1e-4 and learning rate 1e-5 are for FLUX.1's full fine-tuning).

    **Arguments:**

    - `shift_every`: the default `window_shift_every`, epochs between the window's moves.
    - `stride`: the default `window_stride`: 1, or 0 for a window that never moves.
    - `solver`: the ODE solver after the window.
    - `compress_ratio`: `None` keeps the grid after the window; a float rebuilds it.
    - `rollout_steps`: the default `rollout_steps`, or `None` for the job's.
    """

    reads: ClassVar[frozenset[str]] = CLIPS | {"grpo_guard"} | RATIO | SDE_ROLLOUT | RECORDED_WINDOW
    trains_on_ratios: ClassVar[bool] = True
    model_time: ClassVar[ModelTime] = "thousandths"

    shift_every: int
    stride: int = 1
    solver: AbstractSolver = Euler()
    compress_ratio: float | None = None
    rollout_steps: int | None = None

    def check(self, config: Settings) -> None:
        rollout = config.rollout
        if rollout.window_schedule == "fixed":
            raise ValueError(
                "Setting `window_schedule` must be 'progressive', 'sliding' or 'random' with a "
                "MixGRPO algorithm: its SDE window moves along the grid."
            )

    def default_settings(self) -> dict[str, Any]:
        """The released window: one transition later (or none) every `shift_every` epochs."""
        defaults: dict[str, Any] = {
            "window_schedule": "progressive",
            "window_shift_every": self.shift_every,
            "window_stride": self.stride,
        }
        if self.rollout_steps is not None:
            defaults["rollout_steps"] = self.rollout_steps
        return defaults

    def objective(self, job: JobPieces, base: Any) -> FlowGRPOObjective:
        """Flow-GRPO's objective with the released time input (`model_time`)."""
        return self.flow_grpo_objective(job, base)

    advantage_std: ClassVar[AdvantageStd] = "group"

    def sampler(self, job: JobPieces) -> MixSampler:
        """`MixSampler` with the job's SDE and window, restarting past the grid's end."""
        rollout = job.config.rollout
        schedule = window_schedule(rollout, at_end="restart")
        assert schedule is not None  # `check` refuses the fixed window
        return MixSampler(
            rollout_sde(rollout),
            schedule,
            solver=self.solver,
            compress_ratio=self.compress_ratio,
            record_means=job.config.objective.grpo_guard,
        )


@final
class FlowDPPO(AbstractAlgorithm):
    """Flow-DPPO as released (github `Tencent-Hunyuan/UniRL`, `FlowDPPO/`,
    `unirl/algorithms/flowdppo.py`, `examples/diffusion/sd3_flowdppo.yaml`;
    `docs/mathematics/dppo.md` §12): Flow-GRPO's unclipped ratio surrogate on the SDE
    transitions the rollout records, each step dropped where its KL to the rollout's policy
    reaches `dppo_kl_threshold` (1e-5, the release's) and its ratio already moved the way its
    advantage pushes. As released: the KL's std recomputed and clamped at `t = 1`
    (`dppo_kl_std` released; `transition` is the release's open fix), no ratio or advantage
    clip, no KL to the base model, advantages over the batch's unbiased reward std plus 1e-8
    with each group's mean (`adv_use_global_std`), and the SDE on steps drawn per rollout among
    the first half of the grid (`RandomSteps`), the ODE elsewhere. Adapted to this task:

    - The rollout's steps are the job's `sde_steps` (2) drawn among the first half of its
        `rollout_steps - 1` transitions, widened to hold them (the release draws 3 of 5 of
        10): on the job's 5 transitions the first half is transitions 0 and 1, so both every
        rollout, the job's leading window; `--rollout-steps 11 --sde-steps 3` is the
        release's 3 of 5. `sde_steps` none makes every transition stochastic; `train_steps`
        must be none or `sde_steps` (the drawn steps are the trained ones). A moving
        `window_schedule` replaces the drawn steps with its window.
    - The KL's anchor (the rollout policy's means) and the ratio's old log densities come
        from the rollout in float32, and from the update program in bfloat16 (the job's
        `old_log_probs` rule; an explicit `old_log_probs` setting sets both): the release
        replays the means at the pre-update weights, which in float32 is the rollout's to
        about 1e-7, one update-program run per minibatch fewer.
    - The step size and the updates per epoch are the job's (the release makes 2 updates per
        rollout, LoRA at 3e-4).
    """

    reads: ClassVar[frozenset[str]] = (
        frozenset({"dppo_kl_threshold", "dppo_kl_std"}) | RATIO | SDE_ROLLOUT | RECORDED_WINDOW
    )
    trains_on_ratios: ClassVar[bool] = True

    def check(self, config: Settings) -> None:
        if config.objective.beta > 0:
            raise ValueError(
                "Setting `beta` (Flow-GRPO's KL weight) must be 0 with algorithm 'dppo': "
                f"Flow-DPPO has no KL to the base model, got {config.objective.beta!r}."
            )
        if config.objective.grpo_guard:
            raise ValueError(
                "Setting `grpo_guard` must be false with algorithm 'dppo': its KL mask "
                "replaces the clip that GRPO-Guard regulates."
            )
        rollout = config.rollout
        steps = dppo_steps(rollout)
        if steps is not None and rollout.train_steps not in (None, steps.count):
            raise ValueError(
                f"Setting `train_steps`={rollout.train_steps} must equal `sde_steps`="
                f"{rollout.sde_steps} (or be none) with algorithm 'dppo': its drawn SDE "
                "steps are the trained ones."
            )

    def default_settings(self) -> dict[str, Any]:
        return {}

    def objective(self, job: JobPieces, base: Any) -> FlowDPPOObjective:
        """Flow-DPPO's objective on the job's guidance, its KL std and threshold the
        `dppo_kl_std` and `dppo_kl_threshold` settings, its SDE steps `dppo_steps`."""
        config = job.config
        anchor = self.old_log_probs(config)
        steps = dppo_steps(config.rollout)
        sde = rollout_sde(config.rollout)
        if steps is not None:
            sde = FlowSDE(config.rollout.noise_level)
        return FlowDPPOObjective(
            job_flow(job, guidance=job.guidance),
            kl_threshold=config.objective.dppo_kl_threshold,
            kl_std=DPPO_KL_STDS[config.objective.dppo_kl_std],
            sde=sde,
            sde_steps=steps,
            old_log_probs=anchor,
            old_means=anchor,
            transition_chunk=config.objective.transition_chunk,
            pretrained=base,
        )

    advantage_std: ClassVar[AdvantageStd] = "global_unbiased"

    def sampler(self, job: JobPieces) -> SDESampler:
        """The job's SDE on the drawn steps (`dppo_steps`), or the moving window
        (`window_sampler`), recording its means when they are the KL's anchor."""
        rollout = job.config.rollout
        record_means = self.old_log_probs(job.config) == "rollout"
        steps = dppo_steps(rollout)
        if steps is None:
            return window_sampler(rollout, record_means=record_means)
        return SDESampler(
            FlowSDE(rollout.noise_level), window_schedule=steps, record_means=record_means
        )


@final
class DanceGRPO(AbstractAlgorithm):
    """DanceGRPO as released (github `XueZeyue/DanceGRPO`, `fastvideo/train_grpo_flux.py`,
    `train_grpo_hunyuan.py`, `scripts/finetune/finetune_flux_grpo.sh`;
    `docs/mathematics/dancegrpo.md` §13): Flow-GRPO's clipped ratio on the transitions of
    DanceGRPO's constant-noise SDE (`DanceSDE`), every step stochastic but the last, each
    sample trained on its own random 60% of the steps before the last (`DanceSampler`), the
    model fed its time in thousandths. As released: advantages per group with the unbiased std
    plus 1e-8, each clipped to `adv_clip_max` (5), one clipped surrogate per reward (the
    partial and strict rewards, each normalised in its group), initial noise shared by a group,
    no KL to the base model. Adapted to this task:

    - The job's grid (6 points: 2 of the 4 steps before the last per sample, where the
        release trains 9 of FLUX.1's 15), its guidance, noise level 0.3 (the release's eta;
        `noise_level`), and its `sde_steps`, `train_steps` and window unread (every step
        is noisy).
    - The clip is the job's `clip_range` (0.2), the step size and updates per epoch the
        job's (the release's clip 1e-4 and learning rate 1e-5 are for FLUX.1's full
        fine-tuning, as MixGRPO's, which is built on this code).
    """

    reads: ClassVar[frozenset[str]] = (
        frozenset({"clip_range", "adv_clip_max", "noise_level"}) | RATIO
    )
    trains_on_ratios: ClassVar[bool] = True
    model_time: ClassVar[ModelTime] = "thousandths"

    def check(self, config: Settings) -> None:
        if config.rollout.rollout_steps < 4:
            raise ValueError(
                "Setting `rollout_steps` must be at least 4 with algorithm 'dancegrpo': each "
                "sample trains int(0.6 (rollout_steps - 2)) steps, got "
                f"{config.rollout.rollout_steps!r}."
            )

    def default_settings(self) -> dict[str, Any]:
        """The release's noise level."""
        return {"noise_level": 0.3}

    def objective(self, job: JobPieces, base: Any) -> DanceGRPOObjective:
        """DanceGRPO's objective on the job's guidance and clips."""
        config = job.config
        return DanceGRPOObjective(
            GuidedFlow(
                job.model,
                RectifiedFlow(),
                job.inputs,
                job.guidance,
                precision=config.model.precision,
                model_time=self.model_time,
            ),
            sde=DanceSDE(config.rollout.noise_level),
            clip_range=config.objective.clip_range,
            adv_clip_max=config.objective.adv_clip_max,
            old_log_probs=self.old_log_probs(config),
            transition_chunk=config.objective.transition_chunk,
            pretrained=base,
        )

    def flow_grpo_objective(self, job: JobPieces, base: Any) -> FlowGRPOObjective:
        """Flow-GRPO's objective on DanceGRPO's SDE: its `log_probs` and `kept` are
        DanceGRPO's, so the policy-ratio histograms rescore what DanceGRPO trains."""
        objective = super().flow_grpo_objective(job, base)
        sde = DanceSDE(job.config.rollout.noise_level)
        replaced: FlowGRPOObjective = eqx.tree_at(lambda o: o.sde, objective, sde)
        return replaced

    advantage_std: ClassVar[AdvantageStd] = "group_unbiased"

    def sampler(self, job: JobPieces) -> DanceSampler:
        """`DanceSampler` with the job's noise level and the release's 60%."""
        return DanceSampler(DanceSDE(job.config.rollout.noise_level), 0.6)


ALGORITHMS: dict[AlgorithmName, AbstractAlgorithm] = {
    "flow_grpo": FlowGRPO(),
    "nft": NFT(),
    "awm": AWM(),
    "dgpo": DGPO(),
    "mixgrpo": MixGRPO(shift_every=25),
    "mixgrpo-flash": MixGRPO(
        shift_every=20, solver=DPMSolverPP2M(), compress_ratio=0.4, rollout_steps=26
    ),
    "mixgrpo-flash-star": MixGRPO(
        shift_every=20, stride=0, solver=DPMSolverPP2M(), compress_ratio=0.2, rollout_steps=23
    ),
    "dppo": FlowDPPO(),
    "dancegrpo": DanceGRPO(),
}
"""Every algorithm, by its name in the `algorithm` setting."""
