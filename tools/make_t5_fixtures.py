"""Fixtures for `T5Encoder` (`flowgrpo_eqx.models.load_t5`), made with transformers itself.

As the other fixture scripts (read `tools/make_sd3_fixtures.py` for the environment), this runs
by hand in a venv with torch and transformers (transformers 5.25.0, torch 2.13.0 CPU):

    /tmp/venv-torch/bin/python tools/make_t5_fixtures.py

It writes into `tests/data/t5/`:

- `v1_1/`: a tiny random `T5EncoderModel` as T5 v1.1 is configured (gated tanh-GELU
    feed-forward, `d_kv` other than `d_model / num_heads`), and `relu/`: one as the
    original T5 is (`relu`); each with `io.npz`: token ids `ids` (`[2, 40]`: longer than the
    exact buckets, so the logarithmic ones are used), a padding `mask`, and transformers'
    `last_hidden_state` without the mask (`last`, as the SD3 pipelines call it) and with it
    (`last_masked`);
- `t5_keys.json`: every key of T5 v1.1 XXL's encoder with its shape and its parameter count,
    built on torch's 'meta' device from `google/t5-v1_1-xxl`'s `config.json` as SD3's
    `text_encoder_3/` has it.
"""

import json
import pathlib
import sys


OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "t5"
TINY = dict(
    vocab_size=64,
    d_model=24,
    d_kv=10,
    d_ff=40,
    num_layers=2,
    num_heads=3,
    relative_attention_num_buckets=16,
    relative_attention_max_distance=20,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    is_encoder_decoder=False,
    use_cache=False,
)
XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)


def make() -> None:
    import numpy as np
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for name, config in (("v1_1", TINY), ("relu", dict(TINY, feed_forward_proj="relu"))):
        model = T5EncoderModel(T5Config(**config)).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(0.3 * torch.randn_like(param) + 0.02)
        model.save_pretrained(OUT / name, safe_serialization=True)
        ids = rng.integers(2, 64, (2, 40)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[0, 30:] = 0
        with torch.no_grad():
            last = model(torch.from_numpy(ids).long()).last_hidden_state.numpy()
            masked = model(
                torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
            ).last_hidden_state.numpy()
        np.savez(OUT / name / "io.npz", ids=ids, mask=mask, last=last, last_masked=masked)
        print(name, last.shape, float(np.abs(last).mean()))
    with torch.device("meta"):
        xxl = T5EncoderModel(T5Config(**XXL))
    record = {
        "config": XXL,
        "parameters": sum(p.numel() for p in xxl.parameters()),
        "keys": {k: list(v.shape) for k, v in xxl.state_dict().items()},
    }
    (OUT / "t5_keys.json").write_text(json.dumps(record, indent=0) + "\n")
    print("xxl", record["parameters"])


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python tools/make_t5_fixtures.py (no arguments)")
    make()
