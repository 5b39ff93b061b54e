"""Names that differ between the torch releases users run (NGC containers carry several)."""

from __future__ import annotations

import torch.distributed as dist

# torch >= 2.10 renamed all_gather_into_tensor and reduce_scatter_tensor.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
