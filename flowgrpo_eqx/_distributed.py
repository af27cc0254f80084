"""Scale out on JAX's own multi-controller runtime: a data mesh, sharded rows, rank-0 rewards.

One process with many devices shards rows over a `Mesh` data axis and replicates parameters
(or shards them, FSDP); a second mesh axis, `"sequence"`, splits each sample's tokens.
Many processes (`jax.distributed.initialize`; gloo collectives on CPU) run the same program:
the trainer supplies global arrays on every process, generation is collective, and each
process keeps only the rows it owns (the reward runs once on process 0:
`flowgrpo_eqx.rewards`' `score_on_root`).
"""

import contextlib
import itertools
import math
import os
from typing import Any, Literal, TypeAlias, TypeVar, get_args

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._misc import check_int, data_to_keys, keys_to_data


_T = TypeVar("_T")

DATA_AXIS = "data"
SEQUENCE_AXIS = "sequence"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_seconds: int = 20,
    initialization_timeout: int = 120,
) -> None:
    """Start JAX's distributed runtime (a no-op for one process).

    Arguments fall back to the environment variables `FLOWGRPO_COORDINATOR`,
    `FLOWGRPO_NUM_PROCESSES` and `FLOWGRPO_PROCESS_ID`, and then to JAX's own cluster
    detection. On CPU, collectives use gloo.

    **Arguments:**

    - `coordinator`: `HOST:PORT` of process 0's coordination service.
    - `num_processes`: how many processes take part.
    - `process_id`: this process's rank.
    - `heartbeat_timeout_seconds`: how soon the others notice a dead process.
    - `initialization_timeout`: how long to wait for all processes to join.

    **Raises:**

    - `ValueError`: if only some of the three settings are given, they are inconsistent, or
        `coordinator` is not `HOST:PORT`.
    """
    coordinator = coordinator or os.environ.get("FLOWGRPO_COORDINATOR")
    if num_processes is None and "FLOWGRPO_NUM_PROCESSES" in os.environ:
        num_processes = _int_from_environment("FLOWGRPO_NUM_PROCESSES")
    if process_id is None and "FLOWGRPO_PROCESS_ID" in os.environ:
        process_id = _int_from_environment("FLOWGRPO_PROCESS_ID")
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if not any(given):
        return
    if not all(given):
        raise ValueError(
            "`coordinator`, `num_processes` and `process_id` must be given together, got "
            f"{coordinator!r}, {num_processes!r}, {process_id!r}."
        )
    assert num_processes is not None and process_id is not None
    if not 0 <= process_id < num_processes:
        raise ValueError(f"`process_id`={process_id} must be in 0..{num_processes - 1}.")
    host, colon, port = str(coordinator).rpartition(":")
    if not (colon and host and port.isdecimal() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"`coordinator` must be HOST:PORT (a port in 1..65535), got {coordinator!r}."
        )
    if num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        initialization_timeout=initialization_timeout,
    )


def _int_from_environment(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name} must be an int, got {text!r}.") from None


def data_mesh(devices: int | None = None, *, sequence: int = 1) -> Mesh:
    """A mesh over the first `devices` global devices (default: all): one axis, `"data"`, or
    with `sequence > 1` two, `("data", "sequence")` of sizes `devices / sequence` and
    `sequence`.

    Rows are split over `"data"`; the `sequence` devices of one data slot hold the same rows
    and split each sample's tokens between the models' blocks (sequence parallelism, in the
    models that support it: `MMDiT`, `Flux`, `Wan`). FSDP (`shard_parameters`) splits the
    parameters over every device of the mesh.

    **Arguments:**

    - `devices`: how many of `jax.devices()` (in their order) the mesh spans; `None` for all.
    - `sequence`: the size of the sequence axis, dividing `devices`; 1 for none.

    **Returns:**

    A `jax.sharding.Mesh` with the axis `"data"`, and `"sequence"` when `sequence > 1`.

    **Raises:**

    - `ValueError`: naming `devices`, when it is not in `1..len(jax.devices())`, or
        `sequence`, when it is not a positive int dividing `devices`.
    """
    available = jax.devices()
    count = len(available) if devices is None else devices
    if not 1 <= count <= len(available):
        raise ValueError(f"`devices`={devices} must be in 1..{len(available)}.")
    check_int("sequence", sequence, 1)
    if count % sequence != 0:
        raise ValueError(f"`sequence` ({sequence}) must divide the device count ({count}).")
    if sequence == 1:
        return Mesh(np.asarray(available[:count]), (DATA_AXIS,))
    grid = np.asarray(available[:count]).reshape(count // sequence, sequence)
    return Mesh(grid, (DATA_AXIS, SEQUENCE_AXIS))


def data_size(mesh: Mesh) -> int:
    """The size of the mesh's data axis: how many slots the rows are split over."""
    return int(mesh.shape[DATA_AXIS])


def sequence_size(mesh: Mesh | None) -> int:
    """The size of the mesh's sequence axis (1 without a mesh or without the axis)."""
    if mesh is None or SEQUENCE_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[SEQUENCE_AXIS])


def sequence_context(mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
    """`jax.set_mesh(mesh)` when `mesh` splits tokens (a sequence axis larger than 1), so
    that the models traced inside see the axis; otherwise a context that does nothing."""
    if mesh is None or sequence_size(mesh) == 1:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[Any] = jax.set_mesh(mesh)
    return context


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split along the mesh's data axis (and whole along a sequence axis)."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))  # type: ignore[no-untyped-call]


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def shard_batch(tree: PyTree[Any], mesh: Mesh) -> PyTree[Any]:
    """Global arrays whose rows are split over the mesh's data axis.

    Every process passes the same global host values; each device keeps only its rows.

    **Arguments:**

    - `tree`: a PyTree of arrays with a leading row axis (numpy or JAX).
    - `mesh`: the data mesh.

    **Returns:**

    The same PyTree of global `jax.Array`s sharded by rows.

    **Raises:**

    - `ValueError`: if a leaf's row count is not a multiple of the data axis's size.
    """
    sharding = row_sharding(mesh)
    size = data_size(mesh)

    def place(leaf: Any) -> jax.Array:
        host = np.asarray(leaf)
        if host.ndim == 0 or host.shape[0] % size != 0:
            raise ValueError(
                f"Cannot shard an array of shape {host.shape} by rows over the data axis's "
                f"{size} slots: the row count must be a multiple of {size}."
            )
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree)


def place_rows(tree: PyTree[Any], mesh: Mesh | None) -> PyTree[Any]:
    """Host arrays with a leading row axis on the device(s): `shard_batch` over `mesh`, or
    on the default device when `mesh` is `None`."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return shard_batch(tree, mesh)


def replicate(tree: PyTree[Any], mesh: Mesh) -> PyTree[Any]:
    """Global arrays fully replicated over the mesh (parameters, optimizer state, keys).

    Every process passes the same host values. PRNG keys stay keys; leaves that are not
    arrays (activations, static settings) are returned as they are.

    **Arguments:**

    - `tree`: any PyTree, e.g. a `TrainState`.
    - `mesh`: the data mesh.

    **Returns:**

    The same PyTree with every array leaf a global `jax.Array` with a full copy on every
    device of the mesh.
    """
    sharding = replicated(mesh)

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            return leaf
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return data_to_keys(jax.tree.map(place, keys_to_data(tree)), tree)


ParamSharding: TypeAlias = Literal["replicated", "fsdp"]
"""How parameters and optimizer state lie on a data mesh: a full copy on every device, or
fully sharded data parallel (each large array split along one axis over the devices)."""

PARAM_SHARDINGS: tuple[ParamSharding, ...] = get_args(ParamSharding)


def fsdp_spec(
    shape: tuple[int, ...],
    devices: int,
    min_elements: int,
    mesh_axes: str | tuple[str, ...] = DATA_AXIS,
) -> PartitionSpec:
    """The FSDP partition of an array: its largest axis divisible by `devices` goes over the
    mesh axes `mesh_axes`; an array smaller than `min_elements`, or with no such axis, is
    replicated.

    **Arguments:**

    - `shape`: the array's shape.
    - `devices`: the number of devices `mesh_axes` span.
    - `min_elements`: arrays with fewer elements stay replicated (biases, norms, scalars:
        splitting them saves little and costs a gather each).
    - `mesh_axes`: the mesh axis, or axes, the array is split over: `"data"`, or
        `("data", "sequence")` on a mesh with a sequence axis.

    **Returns:**

    A `PartitionSpec`: `PartitionSpec()` (replicated) or `mesh_axes` at one axis.
    """
    if math.prod(shape) < min_elements or devices == 1:
        return PartitionSpec()  # type: ignore[no-untyped-call]
    divisible = [axis for axis, size in enumerate(shape) if size % devices == 0]
    if not divisible:
        return PartitionSpec()  # type: ignore[no-untyped-call]
    axis = max(divisible, key=lambda a: (shape[a], -a))
    spec: list[str | tuple[str, ...] | None] = [None] * len(shape)
    spec[axis] = mesh_axes
    return PartitionSpec(*spec)  # type: ignore[no-untyped-call]


def shard_parameters(
    tree: PyTree[Any],
    mesh: Mesh,
    param_sharding: ParamSharding = "fsdp",
    *,
    min_elements: int = 4096,
) -> PyTree[Any]:
    """Place parameters (policy, reference, EMA) and optimizer state on the mesh: replicated
    or FSDP.

    With `"fsdp"` every array of at least `min_elements` elements is split along one axis
    over every device of the mesh (`fsdp_spec`: the data axis, and the sequence axis too on a
    mesh with one), so each device holds about `1 / devices` of it; the
    trainer's updates keep these shardings (XLA's GSPMD gathers a weight where a computation
    needs it whole). Every process passes the same host values. PRNG keys and arrays too small
    to split are replicated; leaves that are not arrays are returned as they are.

    **Arguments:**

    - `tree`: any PyTree, e.g. a `TrainState`.
    - `mesh`: the data mesh.
    - `param_sharding`: `"replicated"` (as `replicate`) or `"fsdp"`.
    - `min_elements`: with `"fsdp"`, smaller arrays stay replicated.

    **Returns:**

    The same PyTree with every array leaf a global `jax.Array` on the mesh.

    **Raises:**

    - `ValueError`: naming `param_sharding` or `min_elements` when invalid.
    """
    if param_sharding not in PARAM_SHARDINGS:
        raise ValueError(
            f"`param_sharding` must be one of {PARAM_SHARDINGS}, got {param_sharding!r}."
        )
    check_int("min_elements", min_elements, 1)
    size = int(mesh.devices.size)
    names = tuple(mesh.axis_names)
    mesh_axes = names[0] if len(names) == 1 else names

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            return leaf
        host = np.asarray(leaf)
        spec = (
            fsdp_spec(host.shape, size, min_elements, mesh_axes)
            if param_sharding == "fsdp" and host.ndim > 0
            else PartitionSpec()  # type: ignore[no-untyped-call]
        )
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return data_to_keys(jax.tree.map(place, keys_to_data(tree)), tree)


def gather_weights(tree: _T) -> _T:
    """Inside a step on a data mesh, `tree`'s arrays constrained to be whole on every device.

    The usual JAX FSDP pattern: a model calls it on one block's weights where it uses them
    (`MMDiT` and `DiT` do, as their scan reaches each block), so XLA all-gathers that block's
    weight shards just in time and reduce-scatters their gradients back to the shards, while
    the rows (and so the activations) stay split over the data axis. Without the constraint,
    GSPMD may instead gather the activations to meet the sharded weights.

    A no-op outside a mesh context, or on a mesh without the `"data"` axis: the mesh is the
    one `jax.set_mesh` set (`Trainer.update` sets it from the state's shardings).

    **Arguments:**

    - `tree`: a PyTree, typically one block of a model (its arrays are not batched).

    **Returns:**

    `tree` with every array leaf under a replicated sharding constraint.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in mesh.axis_names:
        return tree
    whole = PartitionSpec()  # type: ignore[no-untyped-call]

    def one(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.lax.with_sharding_constraint(leaf, whole)  # type: ignore[no-untyped-call]
        return leaf

    gathered: _T = jax.tree.map(one, tree)
    return gathered


def mesh_of(tree: PyTree[Any]) -> Mesh | None:
    """The mesh of the first array of `tree` placed with a `NamedSharding`, or `None`."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            return mesh if isinstance(mesh, Mesh) else None
    return None


def device_fraction(tree: PyTree[Any]) -> float:
    """The fraction of `tree`'s array bytes that this process's first device holds.

    1 for replicated (or single-device) arrays, about `1 / devices` for FSDP-sharded ones.

    **Arguments:**

    - `tree`: a PyTree of arrays (e.g. a `TrainState`).

    **Returns:**

    Bytes on `jax.local_devices()[0]` over the bytes of the whole arrays (1.0 for no arrays).
    """
    device = jax.local_devices()[0]
    here = whole = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue
        whole += leaf.nbytes
        here += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return here / whole if whole else 1.0


def local_copy(tree: PyTree[Any]) -> PyTree[Any]:
    """This process's own whole copy of global arrays, usable in local computations.

    With one process (every array fully addressable) the tree is returned as it is. With
    several, a replicated array gives its local copy and a sharded one (FSDP parameters) is
    gathered from every process: then every process must call this, in the same order.

    **Arguments:**

    - `tree`: a PyTree of global arrays (e.g. the trained policy, or a `TrainState`).

    **Returns:**

    The same PyTree with each global array that spans other processes replaced by a whole
    copy on this process.
    """

    def take(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            if leaf.is_fully_replicated:
                return leaf.addressable_data(0)
            return jnp.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return leaf

    return jax.tree.map(take, tree)


def owned_rows(tree: PyTree[Any]) -> int:
    """How many rows of a row-sharded global batch this process holds.

    **Arguments:**

    - `tree`: a PyTree of row-sharded arrays (e.g. a `Transitions` batch from
        `FlowRollout.collect`); its first leaf is counted. A NumPy leaf counts all its rows.

    **Returns:**

    The number of distinct rows held by this process's devices.
    """
    leaf = jax.tree.leaves(tree)[0]
    if not isinstance(leaf, jax.Array):
        return int(np.shape(leaf)[0])
    spans = {
        (shard.index[0].start or 0, shard.index[0].stop or leaf.shape[0])
        for shard in leaf.addressable_shards
    }
    return sum(stop - start for start, stop in spans)


def host_samples(samples: jax.Array) -> npt.NDArray[Any]:
    """A row-sharded array whole on the host of every process (e.g. the decoded samples for
    the reward).

    In one process this is a plain transfer. With many processes the rows are all-gathered,
    the one gather JAX's runtime offers; it is collective, so every process must call it.

    **Arguments:**

    - `samples`: a global array, its leading axis split over the processes or not.

    **Returns:**

    The whole array as NumPy.
    """
    if samples.is_fully_addressable:
        return np.asarray(samples)
    gathered: npt.NDArray[Any] = np.asarray(multihost_utils.process_allgather(samples, tiled=True))
    return gathered


def process_counts(value: int) -> list[int]:
    """`value` from every process, in rank order (a tiny all-gather; collective).

    **Arguments:**

    - `value`: this process's count.

    **Returns:**

    Every process's value, process 0's first.
    """
    if jax.process_count() == 1:
        return [value]
    gathered = multihost_utils.process_allgather(np.asarray([value], np.int64))
    return [int(v) for v in np.asarray(gathered).reshape(-1)]


_BARRIERS = itertools.count()


def sync_processes(name: str) -> None:
    """Wait until every process has reached this point (nothing to wait for with one).

    Collective: every process calls it, in the same order.

    **Arguments:**

    - `name`: what the processes wait for, e.g. `"run folder checked"` (a counter makes each
        barrier's name unique).
    """
    if jax.process_count() > 1:
        # Orbax's barrier: the distributed runtime's own, with no computation on the devices.
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(f"flowgrpo_eqx:{name}:{next(_BARRIERS)}")
