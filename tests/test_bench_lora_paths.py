"""`python -m bench.lora_paths` at a tiny size: the folded and per-layer LoRA steps it times
train the same adapters, and the compiled per-layer step does fewer FLOPs than the folded one,
which forms each adapted layer's full weight gradient (what the bench exists to measure)."""

import json

from bench import lora_paths


def test_the_two_lora_paths_give_the_same_gradients_and_the_per_layer_one_does_less_work(capsys):
    lora_paths.main(
        ["--width", "16", "--layers", "2", "--tokens", "32", "--rank", "2", "--rounds", "1",
         "--dtype", "float32"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["adapter_gradient_relative_difference"] < 1e-5
    flops = report["xla_flops"]
    assert flops["per_layer"] < flops["folded"]
    assert flops["forward"] < flops["full"]
    assert set(report["median_ms"]) == {"full", "folded", "per_layer", "forward"}
