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


def test_readme_has_set_up_commands_and_seed_table():
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
