"""The operators at which vLLM's compiled graph of a KVM model splits, as it splits its own models at attention:
`kvm_maglev::token_shift` and `kvm_maglev::attention`, registered with torch.library; and Maglev's
`kvm_maglev::ring_attention`, the attention of a compiled decoding step over a layer's ring pages.

Everything that reads or writes a request's state - token-shift carries, window rings, the state and its folds -
depends on the step's schedule (which requests, at which positions, which of them cross a chunk boundary), so it
runs inside these operators, eagerly, on the step's `RowTokens` and a `KVMCache` over the pages (built once per
step from vLLM's attention metadata). Between them, projections, norms and feed-forwards are traced once and
compiled. No `from __future__ import annotations` here: torch.library reads the operators' signatures.
"""

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

from kvm_maglev.models.common.step_plan import EngineStep
from kvm_maglev.models.kvm.modeling_kvm import token_shift as plain_token_shift
from kvm_maglev.models.maglev.cache_maglev import EngineRing

LIBRARY = Library("kvm_maglev", "FRAGMENT")  # alive as long as the module: the operators' lifetime


def scheduled(layer_name: str, positions: torch.Tensor, output: torch.Tensor):
    """What the operator of the state pages named `layer_name` works on: the served model, the decoder layer's
    index, the step's tokens and its cache over the pages (vLLM's forward context keeps every state layer by name),
    with `output` zeroed - what vLLM's padding, and a run without requests (None), keep."""
    pages = get_forward_context().no_compile_layers[layer_name]
    output.zero_()
    rows = pages.served.step_rows(positions)
    return None if rows is None else (pages.served, pages.index, *rows)


def token_shift(x: torch.Tensor, mix: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                layer_name: str, stream: str, first: str) -> None:
    """Token shift of stream `stream` of layer `layer_name` over the step's scheduled tokens, into `output`."""
    step = scheduled(layer_name, positions, output)
    if step is not None:
        _, index, tokens, cache = step
        output[:, :tokens.total] = plain_token_shift(tokens, x[:, :tokens.total], mix, cache.layers[index], stream,
                                                     first)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
              positions: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The attention of layer `layer_name` (window, state and its folds, pages updated) over the step's scheduled
    tokens, into `output`."""
    step = scheduled(layer_name, positions, output)
    if step is not None:
        served, index, tokens, cache = step
        count = tokens.total
        output[:count] = served.model.layers[index].self_attn.attend_tokens(
            q[:count], k[:count], v[:count], None if gate is None else gate[:count], tokens, cache.layers[index])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """Maglev layer `layer_name`'s attention of one token per request over its ring pages, the token's keys and
    values then written into them (what `MaglevAttention.forward` does with a cache layer, on the step's rings and
    plan), into `output`."""
    pages = get_forward_context().no_compile_layers[layer_name]
    served, index = pages.served, pages.index
    rings, plan = served.step_rings
    ring, attention = rings[index], served.model.layers[index].self_attn
    output.copy_(attention.attend(q, k, v, served.config.decoder_windows[index], ring.read_ring(k, plan.rows), ring,
                                  plan))
    ring.write_tokens(k, v, plan)


def token_shift_fake(x, mix, positions, output, layer_name, stream, first) -> None:
    return None


def attention_fake(q, k, v, gate, positions, output, layer_name) -> None:
    return None


def ring_attention_fake(q, k, v, output, layer_name) -> None:
    return None


direct_register_custom_op("token_shift", token_shift, mutates_args=["output"], fake_impl=token_shift_fake,
                          target_lib=LIBRARY)
direct_register_custom_op("attention", attention, mutates_args=["output"], fake_impl=attention_fake,
                          target_lib=LIBRARY)
direct_register_custom_op("ring_attention", ring_attention, mutates_args=["output"], fake_impl=ring_attention_fake,
                          target_lib=LIBRARY)
SPLITTING_OPS = ["kvm_maglev::token_shift", "kvm_maglev::attention"]


class PagedStep(EngineStep):
    """The layers' handle on an engine step: their token shifts and attention go to the operators above, which find
    the step's requests and pages through vLLM's forward context; `positions` are vLLM's token positions."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def token_shift(self, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, first: str) -> torch.Tensor:
        output = torch.empty_like(x)
        torch.ops.kvm_maglev.token_shift(x, mix, self.positions, output, cache_layer.prefix, name, first)
        return output

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                  cache_layer) -> torch.Tensor:
        output = v.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        torch.ops.kvm_maglev.attention(q, k, v, gate, self.positions, output, cache_layer.prefix)
        return output


class PagedRing(EngineRing):
    """A Maglev layer's ring in a compiled decoding step: its attention goes to `kvm_maglev::ring_attention`, which
    finds the step's ring over the pages (`step_rings` of the served model) through vLLM's forward context."""

    def __init__(self, layer_name: str) -> None:
        self.layer_name = layer_name

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(q)
        torch.ops.kvm_maglev.ring_attention(q, k, v, output, self.layer_name)
        return output
