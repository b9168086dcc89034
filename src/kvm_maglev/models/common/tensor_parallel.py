"""What the models need to run sharded by transformers' tensor parallelism (`from_pretrained(tp_plan="auto")`):
the configs' plans shard the per-head parameters outside the linear layers (token-shift mixes, gate biases,
temperatures) into DTensors with their heads, and the layers read the rank's own part with `local_tensor`, so that
each rank computes its heads - and keeps their state - alone.
"""

from __future__ import annotations

import torch

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch built without distributed has no sharded tensors
    DTensor = ()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter (a DTensor); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_columns(full: torch.Tensor, sharded_like: torch.Tensor) -> torch.Tensor:
    """The last-dimension slice of a replicated `full` that this rank owns when `sharded_like` (a colwise
    DTensor weight) is sharded; `full` as it is without tensor parallelism."""
    if not isinstance(sharded_like, DTensor):
        return full
    mesh = sharded_like.device_mesh
    return full.chunk(mesh.size(), dim=-1)[mesh.get_local_rank()]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor-parallel parameter, gathered from every rank; any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
