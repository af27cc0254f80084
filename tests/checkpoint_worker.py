"""`python -m tests.checkpoint_worker MODE FOLDER ...`: checkpoints in a fresh interpreter.

Run by `tests/test_orbax_checkpoints.py` with `--xla_force_host_platform_device_count` set to
the device count each mode needs (fixed at JAX's start):

- `save FOLDER`: a train state (an MLP's policy, its held copy and AdamW's moments after one
  update) split over every device with FSDP, saved as checkpoint 1; writes every array's
  values to `FOLDER/saved.npz` and prints how the arrays lay on the devices and how many
  were stored as arrays of their own (split ones) or packed (whole ones).
- `restore FOLDER`: a fresh state of the same shapes placed with FSDP on every device (or on
  the one device there is), restored from checkpoint 1; writes `FOLDER/restored_<n>.npz` and
  prints whether every array took the fresh state's sharding.
- `save-loop FOLDER`: checkpoints 1, 2, 3, ... of a 64 MiB state, printing `saving k` before
  and `saved k` after each, until killed. With `pause` as third argument, it saves 1, then
  prints `paused` once Orbax has written checkpoint 2's shards (before `meta.json` and the
  rename) and sleeps.
"""

import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flowgrpo_eqx as fg
from flowgrpo_eqx.train import Checkpointer, _checkpoint


MIN_ELEMENTS = 64


def train_state(seed):
    model = eqx.nn.MLP(6, 4, 32, 2, key=jax.random.key(seed))
    params = eqx.filter(model, eqx.is_array)
    optimizer = optax.adamw(1e-2)
    moments = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, moments = optimizer.update(grads, moments, params)
    return {
        "policy": eqx.apply_updates(params, updates),
        "held": params,
        "optimizer": moments,
        "key": jax.random.key(seed + 1),
    }


def placed(tree):
    if jax.device_count() == 1:
        return tree
    mesh = fg.data_mesh(jax.device_count())
    return fg.shard_parameters(tree, mesh, "fsdp", min_elements=MIN_ELEMENTS)


def host_values(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    values = {}
    for path, leaf in flat:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        values[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return values


def layout(tree):
    arrays = [x for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]
    return {
        "devices": jax.device_count(),
        "sharded_arrays": sum(not x.sharding.is_fully_replicated for x in arrays),
        "arrays": len(arrays),
    }


def save(folder):
    state = placed(train_state(0))
    written = Checkpointer(folder / "checkpoints").save(1, state, {"devices": jax.device_count()})
    np.savez(folder / "saved.npz", **host_values(state))
    places = [
        record[3] for record in json.loads((written / "meta.json").read_text())["state_arrays"]
    ]
    packed = sum(place.startswith("packed_") for place in places)
    print(
        json.dumps({**layout(state), "own_arrays": len(places) - packed, "packed_arrays": packed})
    )


def restore(folder):
    like = placed(train_state(7))
    restored, meta = Checkpointer(folder / "checkpoints").restore(like)
    same_sharding = [
        got.sharding == want.sharding
        for got, want in zip(
            jax.tree.leaves(eqx.filter(restored, eqx.is_array)),
            jax.tree.leaves(eqx.filter(like, eqx.is_array)),
            strict=True,
        )
    ]
    np.savez(folder / f"restored_{jax.device_count()}.npz", **host_values(restored))
    print(json.dumps({**layout(restored), "same_sharding": all(same_sharding), "meta": meta}))


def save_loop(folder, pause):
    def state(step):
        weights = jnp.arange(16 * 2**20, dtype=jnp.float32) + step
        return {"weights": weights, "step": jnp.asarray(step)}

    checkpoints = Checkpointer(folder / "checkpoints", keep=2)
    if pause:
        checkpoints.save(1, state(1), {"epoch": 1})
        print("saved 1", flush=True)
        original = _checkpoint.file_records

        def hold(state_folder):
            print("paused", flush=True)
            time.sleep(600)
            return original(state_folder)

        _checkpoint.file_records = hold
        checkpoints.save(2, state(2), {"epoch": 2})
        return
    for step in range(1, 10_000):
        print(f"saving {step}", flush=True)
        checkpoints.save(step, state(step), {"epoch": step})
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    mode, target = sys.argv[1], pathlib.Path(sys.argv[2])
    if mode == "save":
        save(target)
    elif mode == "restore":
        restore(target)
    elif mode == "save-loop":
        save_loop(target, pause=sys.argv[3:] == ["pause"])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
