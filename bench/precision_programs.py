"""`python -m bench.precision_programs [--depth N]`: what the precision policy changes in the
TPU's program for SD3.5-Medium's bfloat16 training step.

The step of `python -m bench.models --full-size "sd35m b8 splash nothing"` (512², batch 8,
splash attention, bfloat16 weights), with `depth` blocks instead of 24 so that it compiles in
minutes on a CPU host, is compiled ahead of time for one TPU v5e chip (libtpu installed; nothing
runs) twice: at JAX's default matmul precision and under `"highest"`, the library's policy.
Printed: each program's products (`convolution`s) by operand dtype and by the precision they
carry, its temporaries, and the lines in which the two programs differ once names, numbering,
source locations and the precision attribute are set aside. Prints one JSON object.
"""

import argparse
import collections
import json
import re
from typing import Any

import jax
import numpy as np


def _program_text(depth: int, precision: str | None) -> tuple[str, float]:
    """The compiled TPU program's text and its temporaries in GiB."""
    from jax.experimental import topologies

    from bench import _full_size
    from flowgrpo_eqx.models import MMDiT

    row = _full_size.Row(
        "sd35m b8 splash nothing", "sd35_medium", 8, "nothing", "splash",
        matmul_precision=precision,
    )  # fmt: skip
    config = {
        **MMDiT.sd35_medium_config(),
        "depth": depth,
        "dual_attention_layers": tuple(range(min(depth, 13))),
    }
    function, args = _full_size.program(row, mmdit_config=config)
    described = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(described.devices[:1]), ("one",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
    )
    compiled = jax.jit(function).lower(*abstract).compile()
    memory = compiled.memory_analysis()
    return compiled.as_text(), memory.temp_size_in_bytes / 2**30


def _instructions(text: str) -> collections.Counter[str]:
    """The program's instruction lines without names' numbering, source locations and the
    products' precision attribute."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY"))), len(lines))
    found: collections.Counter[str] = collections.Counter()
    for line in lines[start:]:
        line = re.sub(r", metadata=\{.*?\}(?=, [a-z_]+=|$)", "", line)
        line = re.sub(r", operand_precision=\{[^}]*\}", "", line)
        line = re.sub(r", stack_frame_id=\d+", "", line)
        line = re.sub(r"(?<=[A-Za-z_0-9])(\.\d+)+", "", line)
        found[line.strip()] += 1
    return found


def _products(text: str) -> dict[str, int]:
    """The program's products (`convolution`s) by their operands' dtypes and the precision
    they carry."""
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", text))
    kinds: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        match = re.search(r" convolution\(%([\w.-]+), %([\w.-]+)\)", line)
        if match is None:
            continue
        operands = "x".join(types.get(name, "?") for name in match.groups())
        precision = re.search(r"operand_precision=\{(\w+)", line)
        kinds[f"{operands}, {precision.group(1) if precision else 'default'}"] += 1
    return dict(kinds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.precision_programs", description=__doc__)
    parser.add_argument("--depth", type=int, default=2, help="MMDiT blocks (default 2)")
    args = parser.parse_args(argv)
    if args.depth < 1:
        parser.error(f"--depth must be at least 1, got {args.depth}")
    report: dict[str, Any] = {"jax": jax.__version__, "depth": args.depth}
    texts = {}
    for precision in (None, "highest"):
        text, temporaries = _program_text(args.depth, precision)
        name = precision or "default"
        texts[name] = _instructions(text)
        report[name] = {"products": _products(text), "temporaries_gib": round(temporaries, 3)}
    only_default = texts["default"] - texts["highest"]
    only_highest = texts["highest"] - texts["default"]
    report["instruction_lines"] = sum(texts["default"].values())
    report["lines_only_at_default"] = sum(only_default.values())
    report["lines_only_at_highest"] = sum(only_highest.values())
    report["differing_ops"] = sorted(
        {
            m.group(1)
            for line in (*only_default, *only_highest)
            if (m := re.search(r"= \S+ (\w+)\(", line))
        }
    )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
