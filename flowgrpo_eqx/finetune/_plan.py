"""How an epoch's samples and updates are cut over the mesh, checked before any work."""

import dataclasses

import jax

from ._config import FinetuneConfig


class MeshPlanError(ValueError):
    """A mesh or batch setting that does not divide what it must: the message names the
    setting and both numbers."""


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The devices and the cuts of one epoch.

    **Arguments:**

    - `devices`: devices of the mesh.
    - `sequence`: the sequence axis's size.
    - `rollout_rows`: samples per rollout program call (all data slots).
    - `epoch_rows`: samples per epoch.
    - `update_rows`: samples per optimizer update.
    - `microbatches`: microbatches per update.
    - `eval_rows`: samples per evaluation call.
    """

    devices: int
    sequence: int
    rollout_rows: int
    epoch_rows: int
    update_rows: int
    microbatches: int
    eval_rows: int

    @property
    def slots(self) -> int:
        """Data slots: devices that hold different rows."""
        return self.devices // self.sequence

    @property
    def rollout_calls(self) -> int:
        """Rollout program calls per epoch."""
        return self.epoch_rows // self.rollout_rows

    @classmethod
    def of(cls, config: FinetuneConfig) -> "MeshPlan":
        """The plan of a configuration on this process's devices.

        **Raises:**

        - `MeshPlanError`: naming `mesh.devices` when it exceeds the devices there are,
            `mesh.sequence` when it does not divide them, `sampling.batch` when the rollout
            calls do not divide an epoch (or, with shared noise, hold no whole group),
            `training.updates_per_epoch` or `training.batch` when the updates do not divide
            an epoch's samples into whole microbatches.
        """
        available = jax.device_count()
        devices = config.mesh.devices if config.mesh.devices is not None else available
        if devices > available:
            raise MeshPlanError(
                f"Setting `mesh.devices`={devices} must be at most the {available} device(s) "
                "of every process."
            )
        sequence = config.mesh.sequence
        if devices % sequence:
            raise MeshPlanError(
                f"Setting `mesh.sequence`={sequence} must divide the mesh's {devices} devices."
            )
        slots = devices // sequence
        sampling, training = config.sampling, config.training
        epoch_rows = sampling.prompts_per_epoch * sampling.group_size
        rollout_rows = sampling.batch * slots
        if epoch_rows % rollout_rows:
            raise MeshPlanError(
                f"Setting `sampling.batch`={sampling.batch} times the {slots} data slot(s) "
                f"({rollout_rows} samples a call) must divide an epoch's {epoch_rows} samples "
                "(sampling.prompts_per_epoch x sampling.group_size)."
            )
        if sampling.shared_noise and rollout_rows % sampling.group_size:
            raise MeshPlanError(
                f"With `sampling.shared_noise`, a rollout call's {rollout_rows} samples "
                f"(sampling.batch x data slots) must hold whole groups of "
                f"{sampling.group_size}."
            )
        update_rows = epoch_rows // training.updates_per_epoch
        micro_rows = training.batch * slots
        if update_rows % micro_rows:
            raise MeshPlanError(
                f"Setting `training.batch`={training.batch} times the {slots} data slot(s) "
                f"({micro_rows} samples a microbatch) must divide an update's {update_rows} "
                "samples (the epoch's over training.updates_per_epoch)."
            )
        return cls(
            devices=devices,
            sequence=sequence,
            rollout_rows=rollout_rows,
            epoch_rows=epoch_rows,
            update_rows=update_rows,
            microbatches=update_rows // micro_rows,
            eval_rows=sampling.eval_batch * slots,
        )
