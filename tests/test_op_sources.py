"""`bench._op_sources` and `tools.tpu.op_sources`: a profiled step's ops grouped by the JAX
operation and source line that made them, per pass, from the compiled program's metadata."""

import gzip
import json

import pytest

from bench._op_sources import by_function, instruction_metadata, jax_operation, summarise
from tools.tpu.op_sources import by_category, capture, main


# The shape of a TPU program's text (abridged from a compiled SD3.5 step): the same JAX
# operation in the forward and in remat's recomputation, a padding inside the splash
# wrapper's TPU branch, a multi-output fusion of the backward, a kernel's custom call with
# no metadata, and a loop.
FORWARD = "jit(train)/jvp(vmap())/while/body/closed_call/"
BACKWARD = "jit(train)/transpose(jvp(vmap()))/while/body/closed_call/"
INSTRUCTIONS = [
    "%pad.7 = bf16[8,24,1536,64]{3,2,1,0:T(8,128)(2,1)} pad(%a, %z), padding=0_0x0_0x0_179x0_0, "
    f'metadata={{op_name="{FORWARD}cond/branch_0_fun/jit(_pad)/pad" source_line=191}}',
    "%copy.2 = f32[8,1024,24,64]{3,1,2,0:T(8,128)} copy(%b), metadata={op_name="
    f'"{BACKWARD}checkpoint/rematted_computation/convert_element_type" stack_frame_id=2}}',
    "%copy.4 = f32[8,1024,24,64]{3,1,2,0:T(8,128)} copy(%c), "
    f'metadata={{op_name="{FORWARD}convert_element_type" stack_frame_id=2}}',
    "%fusion.3 = (f32[8]{0}, bf16[8,64]{1,0}) fusion(%d), kind=kLoop, calls=%f, "
    f'metadata={{op_name="{BACKWARD}reduce_sum" stack_frame_id=3}}',
    "%splash_mha_fwd_residuals.64 = (f32[8,512,128]{2,1,0:T(8,128)}, "
    'bf16[8,24,1536,64]{3,2,1,0}) custom-call(%pad.7), custom_call_target="tpu_custom_call"',
    "ROOT %while.9 = (s32[], bf16[8,64]{1,0}) while(%e), condition=%c, body=%b",
]
# The tables that number the source lines the stack frames point at.
SOURCES = """FileNames
1 "/work/main/flowgrpo_eqx/models/_layers.py"

FunctionNames
1 "rms_norm"
2 "dense"

FileLocations
1 {file_name_id=1 function_name_id=1 line=79 end_line=79 column=2 end_column=9}
2 {file_name_id=1 function_name_id=1 line=78 end_line=78 column=2 end_column=9}
3 {file_name_id=1 function_name_id=2 line=120 end_line=120 column=2 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=1}

"""
PROGRAM = (
    "HloModule jit_train, is_scheduled=true\n\n"
    + SOURCES
    + "ENTRY %main.5 (x.1: bf16[8,64]) -> f32[8] {\n"
    + "".join(f"  {line}\n" for line in INSTRUCTIONS)
    + "}\n"
)

OPS = [
    {"op": "pad.7", "ms": 2.0, "kind": "other"},
    {"op": "copy.2", "ms": 3.0, "kind": "copies and transposes"},
    {"op": "copy.4", "ms": 1.0, "kind": "copies and transposes"},
    {"op": "fusion.3", "ms": 1.5, "kind": "reductions"},
    {"op": "splash_mha_fwd_residuals.64", "ms": 5.0, "kind": "fused attention (Pallas kernels)"},
    {"op": "while.9", "ms": 100.0, "kind": "loops"},
]


def test_each_instruction_has_its_result_type_op_name_and_source_line():
    metadata = instruction_metadata(PROGRAM)
    assert metadata["pad.7"] == ("bf16", f"{FORWARD}cond/branch_0_fun/jit(_pad)/pad", "")
    assert metadata["copy.2"][0] == "f32"
    assert metadata["copy.2"][2] == "models/_layers.py:78 rms_norm"
    assert metadata["fusion.3"] == (
        "tuple",
        f"{BACKWARD}reduce_sum",
        "models/_layers.py:120 dense",
    )
    assert metadata["splash_mha_fwd_residuals.64"] == ("tuple", "", "")


@pytest.mark.parametrize(
    ("op_name", "expected"),
    [
        ("jit(train)/jvp(vmap())/while/body/closed_call/mul", ("forward", "mul")),
        (
            "jit(train)/transpose(jvp(vmap()))/while/body/closed_call/checkpoint/"
            "rematted_computation/cond/branch_0_fun/transpose",
            ("recomputed", "cond/branch_0_fun/transpose"),
        ),
        (
            "jit(train)/transpose(jvp(vmap()))/while/body/closed_call/checkpoint/add_any",
            ("backward", "add_any"),
        ),
        ("jit(train)/broadcast_in_dim", ("forward", "broadcast_in_dim")),
    ],
)
def test_the_pass_and_operation_are_read_from_the_op_name(op_name, expected):
    assert jax_operation(op_name, "fusion.1") == expected


@pytest.mark.parametrize(
    ("instruction", "name"),
    [
        ("splash_mha_dkv_no_residuals.22", "[splash_mha_dkv_no_residuals]"),
        ("broadcast.245.clone", "[broadcast]"),
        ("copy-done.3", "[copy-done]"),
    ],
)
def test_an_op_without_an_op_name_is_named_by_its_instruction(instruction, name):
    assert jax_operation("", instruction) == ("unnamed", name)


def test_the_same_operation_in_two_passes_is_one_group_and_loops_are_left_out():
    rows = summarise(OPS, instruction_metadata(PROGRAM))
    assert [(r["operation"], r["ms"]) for r in rows] == [
        ("[splash_mha_fwd_residuals]", 5.0),
        ("convert_element_type", 4.0),
        ("cond/branch_0_fun/jit(_pad)/pad", 2.0),
        ("reduce_sum", 1.5),
    ]
    converts = rows[1]
    assert converts["result"] == "f32"
    assert converts["source"] == "models/_layers.py:78 rms_norm"
    assert converts["ms_by_pass"] == {
        "forward": 1.0,
        "recomputed": 3.0,
        "backward": 0.0,
        "unnamed": 0.0,
    }
    assert rows[3]["ms_by_pass"]["backward"] == 1.5


def test_summarise_prints_the_largest_groups_and_the_rest(tmp_path, capsys):
    stem = tmp_path / "row"
    (tmp_path / "row.ops.json").write_text(json.dumps(OPS))
    with gzip.open(tmp_path / "row.hlo.txt.gz", "wt") as handle:
        handle.write(PROGRAM)
    assert main(["summarise", str(stem), "--top", "2"]) == 0
    printed = capsys.readouterr().out
    assert "| 5.0 | fused attention (Pallas kernels) | `[splash_mha_fwd_residuals]` |" in printed
    assert (
        "| 4.0 | copies and transposes | `convert_element_type` | f32 "
        "| `models/_layers.py:78 rms_norm` | 1.0 | 3.0 | 0.0 | 0.0 |"
    ) in printed
    assert "4 groups, 12.5 ms per step; the 2 not shown: 3.5 ms" in printed
    # By function: the kernel's 5.0, then rms_norm's 4.0 (the pad has no source line and
    # stands under its operation; the top 2 shown).
    assert "| 5.0 | `[splash_mha_fwd_residuals]` |\n| 4.0 | `models/_layers.py rms_norm` |" in (
        printed
    )
    assert "| 2.0 | `cond/branch_0_fun/jit(_pad)/pad` |" not in printed


def test_summarise_names_a_missing_capture(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["summarise", str(tmp_path / "absent")])
    assert "absent.ops.json: capture the row first" in capsys.readouterr().err


def test_capture_writes_the_program_and_the_ops_of_a_row(tmp_path, monkeypatch, capsys):
    import jax
    import jax.numpy as jnp

    from bench import _full_size as full_size

    # A small program in the row's place: the capture's steps, not the full-size model.
    def program(row):
        return (lambda a: jnp.tanh(a @ a).sum()), (jax.ShapeDtypeStruct((64, 64), jnp.float32),)

    monkeypatch.setattr(full_size, "program", program)
    capture("sd35m b8 splash nothing", tmp_path)
    with gzip.open(tmp_path / "sd35m_b8_splash_nothing.hlo.txt.gz", "rt") as handle:
        results = {result for result, _, _ in instruction_metadata(handle.read()).values()}
    assert "f32" in results
    ops = json.loads((tmp_path / "sd35m_b8_splash_nothing.ops.json").read_text())
    if jax.default_backend() == "tpu":
        assert ops and set(ops[0]) == {"op", "ms", "calls", "kind"}
    else:
        assert ops == []
        assert "holds no device ops" in capsys.readouterr().out


def test_by_function_sums_every_line_of_a_function():
    rows = summarise(
        [*OPS, {"op": "copy.8", "ms": 0.5, "kind": "copies and transposes"}],
        instruction_metadata(PROGRAM.replace("ROOT %while", EXTRA + "\n  ROOT %while")),
    )
    assert by_function(rows) == [
        ("[splash_mha_fwd_residuals]", 5.0),
        ("models/_layers.py rms_norm", 4.5),
        ("cond/branch_0_fun/jit(_pad)/pad", 2.0),
        ("models/_layers.py dense", 1.5),
    ]


# Another line of rms_norm (line 79, frame 1).
EXTRA = (
    "%copy.8 = f32[8,1024,1536]{2,1,0:T(8,128)} copy(%g), "
    f'metadata={{op_name="{FORWARD}mul" stack_frame_id=1}}'
)


def test_the_bench_profile_sums_the_trace_by_kind_and_by_function(tmp_path):
    from bench._full_size import summarise_trace

    # A trace of two steps on the device's thread, as jax.profiler writes it.
    thread = {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "XLA Ops"}}
    spans = {"copy.2": 3000.0, "copy.4": 1000.0, "fusion.3": 1500.0, "while.9": 9000.0}
    events = [thread] + [
        {"ph": "X", "pid": 1, "tid": 1, "name": op, "dur": us / 2}
        for op, us in spans.items()
        for _ in range(2)
    ]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "host.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    summary = summarise_trace(str(tmp_path), 2, PROGRAM)
    assert summary["device_ms_per_step_by_kind"] == {
        "copies and transposes": 2.0,
        "elementwise fusions": 0.75,
    }
    assert summary["device_ms_per_step_by_function"] == {
        "models/_layers.py rms_norm": 2.0,
        "models/_layers.py dense": 0.75,
    }
    assert summary["loops_ms_spanning_their_ops"] == {"while.9": 4.5}


def test_by_category_sums_the_functions_in_the_categories_order_then_the_rest():
    functions = [
        ("models/_stacked.py StackedLayout._fold", 4.0),
        ("models/_layers.py dense", 3.0),
        ("[splash_mha_fwd_residuals]", 2.0),
        ("[splash_mha_dkv_no_residuals]", 1.5),
        ("models/_layers.py attend_to", 1.0),
        ("models/_splash.py splash_attention.<locals>.run", 0.75),
        ("models/_rope.py apply_rope.<locals>.rotate", 0.5),
        ("models/_layers.py named", 0.25),
        ("models/_layers.py head_rms_norm", 0.125),
        ("[copy-done]", 0.0625),
    ]
    assert by_category(functions) == [
        ("products with the weights", 3.0),
        ("attention kernels", 3.5),
        ("moving queries, keys and values", 1.75),
        ("norms", 0.125),
        ("rotary embedding", 0.5),
        ("the scan over the blocks", 4.0),
        ("the rest", 0.3125),
    ]


def _captured(folder, name):
    (folder / f"{name}.ops.json").write_text(json.dumps(OPS))
    with gzip.open(folder / f"{name}.hlo.txt.gz", "wt") as handle:
        handle.write(PROGRAM)
    return str(folder / name)


def test_plot_draws_each_captured_row(tmp_path):
    from PIL import Image

    stems = [_captured(tmp_path, "row_a"), _captured(tmp_path, "row_b")]
    picture = tmp_path / "steps.png"
    assert main(["plot", *stems, "--out", str(picture)]) == 0
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.width == 1100


def test_plot_names_a_missing_capture(tmp_path, capsys):
    stems = [_captured(tmp_path, "row_a"), str(tmp_path / "absent")]
    with pytest.raises(SystemExit):
        main(["plot", *stems, "--out", str(tmp_path / "x.png")])
    assert "absent.ops.json: capture the row first" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
