"""The torch dtype of each low-precision mode: mixed precision's and the DDP compression hooks'.

A module of its own, below both ``precision`` and ``comm_hooks``, so that neither imports the other.
"""

from __future__ import annotations

import torch

# fp8 autocasts in bf16 around the float8 layers (as Accelerate), which run their own matmuls in fp8.
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
