"""Faults of the command line: settings no run can hold, in flags and in config files, and
subcommands pointed at things that are not there. Each must be refused before any work, in
one line naming the setting (argparse's own usage errors may print the usage first; their
last line names the flag), leaving no run folder behind."""

import functools
import pathlib
from collections.abc import Sequence

from ._probe import Fault, Finding, Judgement, flowgrpo_eqx, judge_refusal, raw_failure, run


LIMIT = 120.0
"""Seconds a refusal may take: long enough for a fault that is accepted to show it (the tiny
job runs in under a minute), short enough that a hang is not waited out."""

# (fault name, flags after `train --preset tiny`, words one of which the refusal must hold)
FLAG_FAULTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("width -1", ("--width", "-1"), ("width",)),
    ("width 0", ("--width", "0"), ("width",)),
    ("width not a number", ("--width", "wide"), ("--width",)),
    ("width 1e9 (no memory holds it)", ("--width", "1000000000"), ("width",)),
    ("depth 0", ("--depth", "0"), ("depth",)),
    ("heads not dividing width", ("--heads", "3"), ("heads",)),
    ("heads 0", ("--heads", "0"), ("heads",)),
    ("patch not dividing the image", ("--patch", "5"), ("patch",)),
    ("patch 0", ("--patch", "0"), ("patch",)),
    ("patch larger than the image", ("--patch", "32"), ("patch",)),
    ("pretrain steps -5", ("--pretrain-steps", "-5"), ("pretrain_steps",)),
    ("pretrain batch 0", ("--pretrain-batch", "0"), ("pretrain_batch",)),
    ("pretrain lr NaN", ("--pretrain-lr", "nan"), ("pretrain_lr",)),
    ("pretrain lr -1", ("--pretrain-lr", "-1"), ("pretrain_lr",)),
    ("cond dropout 1.5", ("--cond-dropout", "1.5"), ("cond_dropout",)),
    ("epochs -1", ("--epochs", "-1"), ("epochs",)),
    ("prompts per epoch 0", ("--prompts-per-epoch", "0"), ("prompts_per_epoch",)),
    ("a group of one sample", ("--groups", "1", "--minibatch-rows", "2"), ("groups",)),
    ("groups 0", ("--groups", "0"), ("groups",)),
    ("rollout steps 1 (no transition)", ("--rollout-steps", "1"), ("rollout_steps",)),
    ("train steps past the trajectory", ("--train-steps", "9"), ("train_steps",)),
    ("sde steps past the trajectory", ("--sde-steps", "9"), ("sde_steps",)),
    ("shared noise 'maybe'", ("--shared-noise", "maybe"), ("shared_noise", "--shared-noise")),
    ("window shift every 0", ("--window-shift-every", "0"), ("window_shift_every",)),
    ("window stride 0", ("--window-stride", "0"), ("window_stride",)),
    ("window schedule unknown", ("--window-schedule", "spiral"), ("--window-schedule",)),
    ("inner epochs 0", ("--inner-epochs", "0"), ("inner_epochs",)),
    ("minibatch rows not dividing a rollout", ("--minibatch-rows", "3"), ("minibatch_rows",)),
    ("learning rate NaN", ("--learning-rate", "nan"), ("learning_rate",)),
    ("learning rate inf", ("--learning-rate", "inf"), ("learning_rate",)),
    ("learning rate -0.1", ("--learning-rate", "-0.1"), ("learning_rate",)),
    ("weight decay -1", ("--weight-decay", "-1"), ("weight_decay",)),
    ("max grad norm 0", ("--max-grad-norm", "0"), ("max_grad_norm",)),
    ("beta -1", ("--beta", "-1"), ("beta",)),
    ("clip range 0", ("--clip-range", "0"), ("clip_range",)),
    ("clip range NaN", ("--clip-range", "nan"), ("clip_range",)),
    ("adv clip max 0", ("--adv-clip-max", "0"), ("adv_clip_max",)),
    ("noise level -0.7", ("--noise-level", "-0.7"), ("noise_level",)),
    ("guidance scale inf", ("--guidance-scale", "inf"), ("guidance_scale",)),
    ("nft beta 2", ("--algorithm", "nft", "--nft-beta", "2"), ("nft_beta",)),
    ("nft old decay -1", ("--algorithm", "nft", "--nft-old-decay", "-1"), ("nft_old_decay",)),
    ("algorithm unknown", ("--algorithm", "ppo"), ("--algorithm",)),
    ("reward unknown", ("--reward", "aesthetic"), ("--reward",)),
    ("reward weights not pairs", ("--reward-weights", "partial"), ("reward_weights",)),
    ("reward weights unknown name", ("--reward-weights", "partial=1,clip=1"), ("reward_weights",)),
    ("reward weights twice", ("--reward-weights", "partial=1,partial=2"), ("reward_weights",)),
    ("reward weight NaN", ("--reward-weights", "partial=nan"), ("reward_weights", "nan")),
    ("custom reward not module:callable", ("--custom-reward", "myreward"), ("custom_reward",)),
    ("custom reward module missing", ("--custom-reward", "no_such_pkg.mod:fn"), ("no_such_pkg",)),
    ("custom reward callable missing", ("--custom-reward", "json:no_such"), ("no_such",)),
    ("custom reward not a reward", ("--custom-reward", "os:getcwd"), ("getcwd", "reward")),
    ("reward url not a url", ("--reward-url", "localhost:8000"), ("reward_url",)),
    (
        "custom reward and reward url",
        ("--custom-reward", "json:loads", "--reward-url", "http://127.0.0.1:9"),
        ("custom_reward",),
    ),
    ("reward timeout 0", ("--reward-timeout", "0"), ("reward_timeout",)),
    ("reward retries -1", ("--reward-retries", "-1"), ("reward_retries",)),
    ("ema decay 1.5", ("--ema-decay", "1.5"), ("ema_decay",)),
    ("transition chunk 0", ("--transition-chunk", "0"), ("transition_chunk",)),
    ("lora rank -1", ("--lora-rank", "-1"), ("lora_rank",)),
    ("lora alpha 0", ("--lora-rank", "4", "--lora-alpha", "0"), ("lora_alpha",)),
    ("eval steps 0", ("--eval-steps", "0"), ("eval_steps",)),
    ("eval samples per prompt 0", ("--eval-samples-per-prompt", "0"), ("eval_samples",)),
    ("eval every 0", ("--eval-every", "0"), ("eval_every",)),
    ("preview prompts -1", ("--preview-prompts", "-1"), ("preview_prompts",)),
    ("seed -1", ("--seed", "-1"), ("seed",)),
    ("seed 1e20 (no key holds it)", ("--seed", "99999999999999999999"), ("seed",)),
    ("eval seed 1e20", ("--eval-seed", "99999999999999999999"), ("eval_seed",)),
    ("precision float16", ("--precision", "float16"), ("--precision",)),
    ("old log probs unknown", ("--old-log-probs", "cached"), ("--old-log-probs",)),
    ("fsdp min elements -1", ("--fsdp-min-elements", "-1"), ("fsdp_min_elements",)),
    ("checkpoint every -1", ("--checkpoint-every", "-1"), ("checkpoint_every",)),
    ("keep checkpoints 0", ("--keep-checkpoints", "0"), ("keep_checkpoints",)),
    ("log to an unknown writer", ("--log", "carrier-pigeon"), ("log",)),
    ("devices 0", ("--devices", "0"), ("devices",)),
    ("more devices than the machine has", ("--devices", "4096"), ("devices",)),
    ("num processes 0", ("--num-processes", "0"), ("num_processes",)),
    (
        "process id past the processes",
        ("--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"),
        ("process_id",),
    ),
    ("coordinator without a port", ("--num-processes", "2", "--process-id", "0",
                                    "--coordinator", "nohost"), ("coordinator",)),
    ("seeds not numbers", ("--seeds", "a,b"), ("seeds",)),
    ("seeds repeated", ("--seeds", "1,1"), ("seeds",)),
    ("seeds empty", ("--seeds", ","), ("seeds",)),
    ("preset unknown", ("--preset", "huge"), ("preset",)),
    ("config file missing", ("--config", "no_such_config.toml"), ("no_such_config.toml",)),
)  # fmt: skip

# (fault name, config.toml text, words one of which the refusal must hold)
CONFIG_FAULTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("config not TOML", "width = = 3\n", ("config.toml",)),
    ("config unknown setting", "wdth = 32\n", ("wdth",)),
    ("config width a string", 'width = "big"\n', ("width",)),
    ("config width a float", "width = 16.5\n", ("width",)),
    ("config seed past any key", "seed = 99999999999999999999\n", ("seed",)),
    ("config boolean as int", "grpo_guard = 1\n", ("grpo_guard",)),
    ("config nested table", "[model]\nwidth = 32\n", ("model",)),
    ("config learning rate NaN", "learning_rate = nan\n", ("learning_rate",)),
    ("config algorithm unknown", 'algorithm = "ppo"\n', ("algorithm",)),
    ("config binary garbage", "\x00\x01\x02\xff", ("config.toml",)),
    # Bytes no UTF-8 text holds (written through surrogateescape): 0xf1 0xf2.
    ("config not UTF-8 text", "width = 16\n\udcf1\udcf2 = 3\n", ("is not UTF-8 text",)),
)


# (fault name, flags after `train --preset tiny`, words one of which the refusal must hold):
# settings that the chosen algorithm does not read, which were written to config.toml and
# ignored.
UNREAD_FAULTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("--dppo-kl-threshold 0.5 with flow_grpo", ("--dppo-kl-threshold", "0.5"),
     ("`dppo_kl_threshold`=0.5 (read by dppo) is not read by algorithm 'flow_grpo'",)),
    ("--clip-range 0.01 with dppo", ("--algorithm", "dppo", "--clip-range", "0.01"),
     ("`clip_range`=0.01 (read by flow_grpo",)),
    ("--clip-range at its default with dppo", ("--algorithm", "dppo", "--clip-range", "0.2"),
     ("`clip_range` (read by flow_grpo",)),
    ("--adv-clip-max 2 with dppo", ("--algorithm", "dppo", "--adv-clip-max", "2"),
     ("`adv_clip_max`",)),
    ("--grpo-guard true with dgpo", ("--algorithm", "dgpo", "--grpo-guard", "true"),
     ("`grpo_guard`",)),
    ("--noise-level 0.3 with nft", ("--algorithm", "nft", "--noise-level", "0.3"),
     ("`noise_level`",)),
    ("--nft-beta 0.5 with awm", ("--algorithm", "awm", "--nft-beta", "0.5"), ("`nft_beta`",)),
    ("--window-stride 2 with dgpo", ("--algorithm", "dgpo", "--window-stride", "2"),
     ("`window_stride`",)),
)  # fmt: skip


def _config_unread(workdir: pathlib.Path) -> Judgement:
    """A config file giving `clip_range = 0.01` and `grpo_guard = true`, with `--algorithm
    dppo`: its values are left at their defaults with one warning naming both (the file may
    be another run's config.toml), and the settings printed hold the defaults."""
    config = workdir / "config.toml"
    config.write_text("clip_range = 0.01\ngrpo_guard = true\ndppo_kl_threshold = 0.001\n")
    ran = run(
        flowgrpo_eqx("train", "--preset", "tiny", "--config", config, "--algorithm", "dppo",
                     "--print-config"),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    failure = raw_failure(ran, LIMIT)
    if failure is not None:
        return failure
    said = [line for line in ran.stderr.splitlines() if line.strip()]
    printed = ran.stdout.splitlines()
    if ran.status != 0:
        return Judgement("unnamed", f"refused (exit {ran.status}): {' '.join(said)[-200:]}")
    if "clip_range = 0.01" in printed or "grpo_guard = true" in printed:
        return Judgement("accepted", "the settings printed hold the values dppo ignores")
    if len(said) != 1 or "`clip_range`=0.01" not in said[0] or "`grpo_guard`" not in said[0]:
        return Judgement("unnamed", f"{len(said)} lines: {' '.join(said)[-200:]}")
    if "dppo_kl_threshold = 0.001" not in printed:
        return Judgement("lost", "the setting dppo reads was not kept")
    return Judgement("held", f"one warning, the defaults kept: {said[0][:150]}")


def _train_refused(flags: Sequence[str], names: Sequence[str], workdir: pathlib.Path) -> Judgement:
    out = workdir / "run"
    ran = run(
        flowgrpo_eqx("train", "--preset", "tiny", "--quiet", "--out", out, *flags),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    return judge_refusal(ran, limit=LIMIT, names=names, litter=out)


def _config_refused(text: str, names: Sequence[str], workdir: pathlib.Path) -> Judgement:
    config = workdir / "config.toml"
    config.write_bytes(text.encode("utf-8", "surrogateescape"))
    return _train_refused(("--config", str(config)), names, workdir)


def _command_refused(
    arguments: Sequence[str], names: Sequence[str], workdir: pathlib.Path
) -> Judgement:
    ran = run(flowgrpo_eqx(*arguments), timeout=LIMIT, cwd=workdir)
    return judge_refusal(ran, limit=LIMIT, names=names)


def _eval_of_missing_run(workdir: pathlib.Path) -> Judgement:
    return _command_refused(("eval", "--run", str(workdir / "nowhere")), ("nowhere",), workdir)


def _eval_of_empty_folder(workdir: pathlib.Path) -> Judgement:
    (workdir / "empty").mkdir()
    return _command_refused(("eval", "--run", str(workdir / "empty")), ("empty",), workdir)


def _eval_of_a_text_file(workdir: pathlib.Path) -> Judgement:
    policy = workdir / "policy.eqx"
    policy.write_text("not a policy\n")
    return _command_refused(
        ("eval", "--preset", "tiny", "--checkpoint", str(policy)), ("policy.eqx",), workdir
    )


def _eval_of_an_empty_file(workdir: pathlib.Path) -> Judgement:
    policy = workdir / "policy.eqx"
    policy.touch()
    return _command_refused(
        ("eval", "--preset", "tiny", "--checkpoint", str(policy)), ("policy.eqx",), workdir
    )


def _eval_without_a_policy(workdir: pathlib.Path) -> Judgement:
    return _command_refused(("eval", "--preset", "tiny"), ("--run", "--checkpoint"), workdir)


def _out_is_a_file(workdir: pathlib.Path) -> Judgement:
    out = workdir / "run"
    out.write_text("a file where the run folder goes\n")
    ran = run(
        flowgrpo_eqx("train", "--preset", "tiny", "--quiet", "--out", out),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    kept = {"run": out.read_bytes()}
    judgement = judge_refusal(ran, limit=LIMIT, names=("is a file, not a folder",))
    if judgement.verdict == "named" and out.read_bytes() != kept["run"]:
        return Judgement("lost", "the file at --out was changed")
    return judgement


def _out_under_a_file(workdir: pathlib.Path) -> Judgement:
    blocker = workdir / "file"
    blocker.write_text("x\n")
    ran = run(
        flowgrpo_eqx("train", "--preset", "tiny", "--quiet", "--out", blocker / "run"),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    return judge_refusal(ran, limit=LIMIT, names=(f"under {blocker}, which is a file",))


def _pretrain_out_is_a_file(workdir: pathlib.Path) -> Judgement:
    out = workdir / "base"
    out.write_text("x\n")
    ran = run(
        flowgrpo_eqx("pretrain", "--preset", "tiny", "--quiet", "--out", out),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    return judge_refusal(ran, limit=LIMIT, names=("is a file, not a folder",))


def _eval_out_is_a_file(workdir: pathlib.Path) -> Judgement:
    """Measured first, then refused with "[Errno 17] File exists" when it wrote its picture."""
    policy = workdir / "base.eqx"
    pretrained = run(
        flowgrpo_eqx("pretrain", "--preset", "tiny", "--quiet", "--pretrain-steps", "1",
                     "--out", workdir / "pretrained"),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    if pretrained.status != 0:
        raise Finding("unprobed", f"pretraining failed: {pretrained.stderr.strip()[-200:]}")
    next((workdir / "pretrained").glob("base_*.eqx")).rename(policy)
    out = workdir / "eval"
    out.write_text("x\n")
    ran = run(
        flowgrpo_eqx("eval", "--preset", "tiny", "--pretrain-steps", "1", "--checkpoint", policy,
                     "--out", out),
        timeout=LIMIT, cwd=workdir,
    )  # fmt: skip
    return judge_refusal(ran, limit=LIMIT, names=("is a file, not a folder",))


def _check_with_a_missing_factory(workdir: pathlib.Path) -> Judgement:
    return _command_refused(
        ("check", "--preset", "tiny", "--factory", "no_such_pkg:make"), ("no_such_pkg",), workdir
    )


def _launch_zero_processes(workdir: pathlib.Path) -> Judgement:
    return _command_refused(
        ("launch", "--local", "0", "train", "--preset", "tiny"), ("--local",), workdir
    )


def _serve_reward_port(port: str, names: Sequence[str], workdir: pathlib.Path) -> Judgement:
    return _command_refused(("serve-reward", "partial", "--port", port), names, workdir)


def _serve_unknown_reward(workdir: pathlib.Path) -> Judgement:
    return _command_refused(
        ("serve-reward", "no_such_pkg:reward", "--port", "0"), ("no_such_pkg",), workdir
    )


def _serve_off_loopback_without_token(workdir: pathlib.Path) -> Judgement:
    return _command_refused(
        ("serve-reward", "partial", "--host", "0.0.0.0", "--port", "0"), ("token",), workdir
    )


def _preset_before_the_subcommand(workdir: pathlib.Path) -> Judgement:
    before = run(flowgrpo_eqx("--preset", "tiny", "train", "--print-config"), timeout=LIMIT)
    after = run(flowgrpo_eqx("train", "--preset", "tiny", "--print-config"), timeout=LIMIT)
    for ran in (before, after):
        if (failure := judge_refusal(ran, limit=LIMIT, names=())).verdict in ("hang", "traceback"):
            return failure
    if before.status == after.status == 0 and before.stdout == after.stdout:
        return Judgement("held", "`--preset tiny train` resolves as `train --preset tiny`")
    return Judgement("unnamed", f"exit {before.status}: {before.stderr.strip()[-200:]}")


def faults() -> list[Fault]:
    """The command line's faults: `FLAG_FAULTS`, `CONFIG_FAULTS` and the subcommands'."""
    found = [
        Fault("settings", name, functools.partial(_train_refused, flags, names))
        for name, flags, names in FLAG_FAULTS
    ]
    found += [
        Fault("config", name, functools.partial(_config_refused, text, names))
        for name, text, names in CONFIG_FAULTS
    ]
    found += [
        Fault("unread settings", name, functools.partial(_train_refused, flags, names))
        for name, flags, names in UNREAD_FAULTS
    ]
    found.append(
        Fault("unread settings", "a config file's clip_range and grpo_guard with dppo",
              _config_unread)
    )  # fmt: skip
    found += [
        Fault("commands", "eval of a run folder that does not exist", _eval_of_missing_run),
        Fault("commands", "eval of an empty folder", _eval_of_empty_folder),
        Fault("commands", "eval of a text file as a policy", _eval_of_a_text_file),
        Fault("commands", "eval of an empty policy file", _eval_of_an_empty_file),
        Fault("commands", "eval with no run and no checkpoint", _eval_without_a_policy),
        Fault("commands", "train --out is a file", _out_is_a_file),
        Fault("commands", "train --out under a file", _out_under_a_file),
        Fault("commands", "pretrain --out is a file", _pretrain_out_is_a_file),
        Fault("commands", "eval --out is a file", _eval_out_is_a_file),
        Fault("commands", "check with a factory that does not import",
              _check_with_a_missing_factory),
        Fault("commands", "launch 0 processes", _launch_zero_processes),
        Fault("commands", "serve-reward --port 99999",
              functools.partial(_serve_reward_port, "99999", ("port",))),
        Fault("commands", "serve-reward --port -1",
              functools.partial(_serve_reward_port, "-1", ("port",))),
        Fault("commands", "serve-reward an unknown reward", _serve_unknown_reward),
        Fault("commands", "serve-reward off loopback without a token",
              _serve_off_loopback_without_token),
        Fault("commands", "--preset before the subcommand", _preset_before_the_subcommand),
    ]  # fmt: skip
    return found
