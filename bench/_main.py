"""`python -m bench [--quick]`: measure, then print one JSON object to stdout."""

import argparse
import importlib.metadata
import json
import os
import platform
import time
from typing import Any

import jax

from ._measure import Plan, measure
from ._setups import dit_setup, mlp_setup
from ._timing import compile_counter, log


TARGETS = {
    "step_utilization": (">=", 0.80),
    "objective_overhead": ("<=", 1.10),
    "rollout_overhead": ("<=", 1.15),
    "memory_k10_over_k1.chunk_1": ("<=", 1.5),
    "recompiles_after_warmup": ("==", 0),
}


def _lookup(figures: dict[str, Any], dotted: str) -> Any:
    value: Any = figures
    for part in dotted.split("."):
        value = None if value is None else value.get(part)
    return value


def targets(figures: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (op, bound) in TARGETS.items():
        value = _lookup(figures, name)
        if value is None:
            met = None
        elif op == ">=":
            met = value >= bound
        elif op == "<=":
            met = value <= bound
        else:
            met = value == bound
        out[name] = {"target": f"{op} {bound}", "value": value, "met": met}
    out["all_met"] = all(entry["met"] for entry in list(out.values()))
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller DiT")
    parser.add_argument("--skip-dit", action="store_true", help="only the MLP configuration")
    parser.add_argument(
        "--only-timing",
        action="store_true",
        help="skip the memory and recompile checks (for A/B runs under other XLA_FLAGS)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    compile_counter()  # listen from the start
    info = machine()
    quick = args.quick
    output: dict[str, Any] = {"machine": info, "mode": "quick" if quick else "full"}

    mlp_plan = Plan(
        rounds_step=9 if quick else 21,
        rounds_rollout=15 if quick else 31,
        recompiles=not args.only_timing,
        memory=not args.only_timing,
    )
    mlp = mlp_setup(quick)
    log(f"MLP: {mlp.config['model']}, N={mlp.config['N']}, K={mlp.config['K']}")
    output["mlp"] = measure(mlp, mlp_plan)
    config = {"mlp": mlp.config, "mlp_plan": vars(mlp_plan)}
    del mlp

    if not args.skip_dit:
        dit_plan = Plan(
            rounds_step=3 if quick else 7,
            rounds_rollout=7 if quick else 15,
            recompiles=not (quick or args.only_timing),
            memory=not (quick or args.only_timing),
        )
        dit = dit_setup(quick)
        log(f"DiT: {dit.config['model']}, N={dit.config['N']}, K={dit.config['K']}")
        output["dit"] = measure(dit, dit_plan)
        config["dit"] = dit.config
        config["dit_plan"] = vars(dit_plan)

    output["targets"] = targets(output["mlp"])
    output["targets"]["evaluated_on"] = "mlp"
    output["config"] = config
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    output["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(output, indent=2))
    return 0
