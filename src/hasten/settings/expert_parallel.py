"""Expert parallelism's settings: ``ParallelismConfig.ep_size`` is checked here, and
``TorchExpertParallelConfig`` declares which modules are experts (hasten's handler; see
``hasten.strategies.expert_parallel`` for what runs). Importing this module does not import torch.

``ep`` is carved out of the data-parallel sharding dim, as in torchtitan: ``dp_shard_size =
efsdp x ep_size``. The ranks of an ep group read different batches and each holds
``num_experts / ep_size`` experts of every MoE layer; the experts are sharded further over
``efsdp`` by FSDP2, everything else over the whole data dims as without ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TorchExpertParallelConfig:
    """Which modules expert parallelism splits (``ParallelismConfig.ep_handler``).

    ``experts``: module-name patterns (``*`` stands for one name, e.g. ``"layers.*.mlp.experts"``)
    or module class names (``"MyExperts"``). None: the model's own declaration (transformers'
    ``_ep_plan`` / ``config.base_model_ep_plan``), else every module holding 3-D ``gate_up_proj``
    and ``down_proj`` parameters. Each module named must have transformers' experts layout
    (``gate_up_proj [E, 2*I, H]``, ``down_proj [E, H, I]``, ``act_fn``, and
    ``forward(hidden_states, top_k_index, top_k_weights)``).
    """

    experts: list[str] | None = None

    def __post_init__(self) -> None:
        if self.experts is None:
            return
        if isinstance(self.experts, str):
            self.experts = [self.experts]
        if not isinstance(self.experts, (list, tuple)) or not self.experts:
            raise TypeError(
                f"TorchExpertParallelConfig.experts must be a non-empty list of module-name patterns or class names "
                f"(e.g. ['layers.*.mlp.experts']), got {self.experts!r}"
            )
        for name in self.experts:
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"TorchExpertParallelConfig.experts entries must be module names, patterns or class names, "
                    f"got {name!r}"
                )
        self.experts = list(self.experts)


def check_expert_parallel(config: Any) -> None:
    """``ParallelismConfig`` with ``ep_size``: the handler's type; ``ep_size`` must divide
    ``dp_shard_size``; what hasten's expert parallelism does not run yet is refused, naming it."""
    owner = "ParallelismConfig"
    if config.ep_handler is not None and not isinstance(config.ep_handler, TorchExpertParallelConfig):
        raise TypeError(f"{owner}.ep_handler must be a TorchExpertParallelConfig or None, got {config.ep_handler!r}")
    if config.ep_size == 1:
        return
    if config.dp_shard_size % config.ep_size:
        raise ValueError(
            f"{owner}(ep_size={config.ep_size}, dp_shard_size={config.dp_shard_size}): ep_size must divide "
            f"dp_shard_size (the experts are split over ep_size of the FSDP ranks and sharded over the other "
            f"dp_shard_size / ep_size); choose an ep_size among the divisors of {config.dp_shard_size}"
        )
    for other in ("cp_size", "sp_size"):
        if getattr(config, other) > 1:
            raise ValueError(
                f"{owner}(ep_size={config.ep_size}, {other}={getattr(config, other)}) is not supported yet: expert "
                f"parallelism runs with FSDP/HSDP, TP (not on the experts) and PP; set {other}=1 (or ep_size=1)"
            )
