"""``accelerate.utils.megatron_lm``'s one helper that needs no Megatron-LM:
``avg_losses_across_data_parallel_group``. (Megatron-LM itself is refused: hasten's tensor,
context, pipeline and HSDP parallelism are ``ParallelismConfig``'s.)"""

from __future__ import annotations

import torch

__all__ = ["avg_losses_across_data_parallel_group"]


def avg_losses_across_data_parallel_group(losses: list[torch.Tensor]) -> torch.Tensor:
    """The mean of each loss over the processes, as one tensor (one value per loss), as
    Megatron-LM's ``average_losses_across_data_parallel_group`` computes it over its
    data-parallel group: here every process of the run (each one a data-parallel replica in
    DDP and FSDP runs; with a ``ParallelismConfig`` that splits the model, average over the data
    ranks with ``accelerator.gather_for_metrics``). One process: the losses as they are."""
    import torch.distributed as dist

    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    if not (dist.is_available() and dist.is_initialized()):
        return averaged
    dist.all_reduce(averaged)
    return averaged / dist.get_world_size()
