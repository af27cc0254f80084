"""The README's example of a user model and reward runs as written."""

import pathlib
import re


README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_user_model_example_runs(capsys):
    blocks = python_blocks()
    example = next(b for b in blocks if "class MyVelocity" in b)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(example, str(README), "exec"), namespace)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 3
    for line in printed:
        epoch, reward, loss, clipfrac = line.split()
        assert float(reward) <= 0.0  # minus a squared error
        assert 0.0 <= float(clipfrac) <= 1.0
    state = namespace["state"]
    assert int(state.step) == 3 * 2  # 3 epochs x (16 rows / 8 per minibatch)


def test_readme_has_set_up_commands_and_name_table():
    text = README.read_text()
    assert 'pip install -e ".[dev]"' in text
    assert "python -m pytest" in text
    for name in (
        "FlowGRPOObjective",
        "FlowReward",
        "FlowRollout",
        "InputSpec",
        "FlowSDE",
        "CFG",
        "Euler",
        "AutoEncoder",
        "Variables",
        "Batch",
        "Step",
        "Mean",
        "Aux",
    ):
        assert f"`{name}" in text, name


def test_readme_config_file_example_is_a_valid_config(tmp_path):
    from flowgrpo_eqx.shapes_demo import make_config
    from flowgrpo_eqx.shapes_demo.config import read_config_file

    block = next(
        b
        for b in re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
        if "learning_rate" in b
    )
    path = tmp_path / "run.toml"
    path.write_text(block)
    config = make_config(**read_config_file(path))
    assert config.training.learning_rate == 3e-4 and config.rollout.train_steps is None
    assert config.logging.log == ("tensorboard",)


def test_readme_dew_table_has_a_row_for_every_argument():
    """Each argument of `dew.objectives.rl.flow` (and its batch fields) opens a table row."""
    text = README.read_text()
    section = text[text.index("## Coming from `dew.objectives.rl.flow`") :]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| ")]
    for argument in (
        # FlowGRPOObjective(...)
        "model",
        "process",
        "inputs",
        "sde",
        "beta",
        "clip_range",
        "adv_clip_max",
        "autoencoder",
        "guidance",
        "sampler",
        "steps",
        "pretrained",
        # its methods
        "key",
        "variables",
        "params",
        "batch",
        "step",
        "scored",
        # FlowRollout(...)
        "objective",
        "reward",
        "groups",
        "train_steps",
        # the batch
        "latents",
        "next_latents",
        "timesteps",
        "next_timesteps",
        "old_log_probs",
        "transition_mask",
        "advantages",
        # distribution
        "shard_batch",
        "collective_host",
    ):
        assert any(re.search(rf"\b{argument}\b", cell) for cell in first_cells), argument


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : len(text) if end < 0 else end]


def test_the_first_screen_says_what_it_is_then_install_a_short_run_the_main_job_and_the_library():
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    first = [
        "Install",
        "A one-minute run",
        "The main job",
        "Fine-tune a published model",
        "The library in ten lines",
    ]
    assert headings[:5] == first
    # What it is comes before any of them.
    assert "library for **online RL fine-tuning" in text[: text.index("\n## Install\n")]
    install = _section(text, "Install")
    assert "git clone" in install and "python3 -m venv" in install and "pip install -e ." in install
    assert "flowgrpo-eqx train --preset tiny" in _section(text, "A one-minute run")
    main_job = _section(text, "The main job")
    assert "flowgrpo-eqx train --out" in main_job
    finetune = _section(text, "Fine-tune a published model")
    assert "flowgrpo-eqx finetune configs/" in finetune
    for config in re.findall(r"`(configs/[^`]+\.toml)`", finetune):
        assert (README.parent / config).is_file(), config
    # Its time on a CPU and on a TPU, as ranges.
    assert re.search(r"\d to \d+ minutes on one TPU", main_job)
    assert "minutes on a 2-core CPU" in main_job and re.search(r"\d+ to \d+ s wall", main_job)
    library = _section(text, "The library in ten lines")
    code = re.search(r"```python\n(.*?)```", library, flags=re.S)
    assert code is not None
    lines = [line for line in code.group(1).splitlines() if line.strip()]
    assert len(lines) <= 10
    compile(code.group(1), "README: the library in ten lines", "exec")
    # No dated lab figures on the first screen: they live in docs/performance.md.
    first_screen = text[: text.index("\n## The library in ten lines\n")] + library
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", first_screen)
    assert "this 2-core CPU" not in first_screen
