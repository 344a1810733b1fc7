"""The Accelerator's read-only views of the run: this process's place in it and on the N-D mesh.

A mixin of :class:`hasten.Accelerator` (kept here so the facade stays small); each property reads
the run's state (``self.state``, a ``RunState``) or the mesh built at ``Accelerator(...)``.
"""

from __future__ import annotations

import torch

from hasten.settings import parallelism as nd


class ProcessFacts:
    """This process's facts as Accelerate's ``Accelerator`` names them: read from the class's ``state``
    (a ``RunState``), ``parallelism_config`` and ``_mesh``, which the Accelerator sets."""

    @property
    def device(self) -> torch.device:
        """Where this process computes (its GPU, else the CPU); prepared models and batches go there."""
        return self.state.device

    @property
    def num_processes(self) -> int:
        """The number of processes of the run, on all machines."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """This process's rank among all processes (0 .. `num_processes` - 1)."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """Whether this is process 0 of the run (the one that writes shared files)."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is process 0 of its machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the last process of the run."""
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        """Whether the run has more than one process."""
        return self.state.use_distributed

    # N-D parallelism (hasten.settings.parallelism): the mesh and this process's place on it
    @property
    def torch_device_mesh(self) -> torch.distributed.device_mesh.DeviceMesh | None:
        """The N-D parallelism mesh (None without `parallelism_config`, or with nothing to split)."""
        return self._mesh

    @property
    def data_parallel_rank(self) -> int:
        """This process's index on the mesh's ``dp_replicate`` dimension (0 where its size is 1); without
        `parallelism_config` a RuntimeError, as in Accelerate."""
        return nd.mesh_rank(self.parallelism_config, self._mesh, "dp_replicate", "data_parallel_rank")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's index on the mesh's ``dp_shard`` dimension (0 where its size is 1); without
        `parallelism_config` a RuntimeError, as in Accelerate."""
        return nd.mesh_rank(self.parallelism_config, self._mesh, "dp_shard", "data_parallel_shard_rank")

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's index on the mesh's ``tp`` dimension (0 where its size is 1); without `parallelism_config`
        a RuntimeError, as in Accelerate."""
        return nd.mesh_rank(self.parallelism_config, self._mesh, "tp", "tensor_parallel_rank")

    @property
    def context_parallel_rank(self) -> int:
        """This process's index on the mesh's ``cp`` dimension (0 where its size is 1); without `parallelism_config`
        a RuntimeError, as in Accelerate."""
        return nd.mesh_rank(self.parallelism_config, self._mesh, "cp", "context_parallel_rank")

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's index on the mesh's ``pp`` dimension (0 where its size is 1); without `parallelism_config`
        a RuntimeError, as in Accelerate."""
        return nd.mesh_rank(self.parallelism_config, self._mesh, "pp", "pipeline_parallel_rank")
