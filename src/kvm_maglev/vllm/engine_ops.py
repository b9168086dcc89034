"""The operators at which vLLM's compiled graph of a KVM model splits, as it splits its own models at attention:
`kvm_maglev::token_shift` and `kvm_maglev::attention`, registered with torch.library; and Maglev's
`kvm_maglev::ring_attention`, the attention of a compiled decoding step over a layer's ring pages. The engine's
kinds of `Step` (`PagedStep`, `PagedDecodeStep`) launch them.

Everything that reads or writes a request's state - token-shift carries, window rings, the state and its folds -
depends on the step's schedule (which requests, at which positions, which of them cross a chunk boundary), so it
runs inside these operators, eagerly, on the model's own kind of `Step` for the scheduled tokens (a `DecodeStep`
when every request decodes, else a `PromptStep`) and a `KVMCache` over the pages, both built once per engine step
from vLLM's attention metadata. The traced forward runs on a `PagedStep`, the kind of `Step` whose token shifts and
attention launch these operators. Between them, projections, norms and feed-forwards are traced once and
compiled. No `from __future__ import annotations` here: torch.library reads the operators' signatures.
"""

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

from kvm_maglev.models.common.step_plan import Step
from kvm_maglev.models.maglev.cache_maglev import TokenStep

LIBRARY = Library("kvm_maglev", "FRAGMENT")  # alive as long as the module: the operators' lifetime


def scheduled(layer_name: str, positions: torch.Tensor, output: torch.Tensor):
    """What the operator of the state pages named `layer_name` works on: the served model, the decoder layer's
    index, the engine step's model `Step`, its count of scheduled tokens and its cache over the pages (vLLM's forward
    context keeps every state layer by name), with `output` zeroed - what vLLM's padding, and a run without requests
    (None), keep."""
    pages = get_forward_context().no_compile_layers[layer_name]
    output.zero_()
    rows = pages.served.step_rows(positions)
    return None if rows is None else (pages.served, pages.index, *rows)


def token_shift(x: torch.Tensor, mix: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                layer_name: str, stream: str, first: str) -> None:
    """Token shift of stream `stream` of layer `layer_name` over the step's scheduled tokens, into `output`."""
    scheduled_step = scheduled(layer_name, positions, output)
    if scheduled_step is not None:
        _, index, step, count, cache = scheduled_step
        output[:, :count] = step.token_shift(x[:, :count], mix, cache.layers[index], stream, first)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
              positions: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The attention of layer `layer_name` (window, state and its folds, pages updated) over the step's scheduled
    tokens, into `output`."""
    scheduled_step = scheduled(layer_name, positions, output)
    if scheduled_step is not None:
        served, index, step, count, cache = scheduled_step
        output[:count] = step.attend(served.model.layers[index].self_attn, cache.layers[index], q[:count], k[:count],
                                     v[:count], None if gate is None else gate[:count])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """Maglev layer `layer_name`'s attention of one token per request over its ring pages, the token written into
    them (the model's decoding `TokenStep` over the step's rings: `MaglevAttention.attend_token`), into `output`."""
    pages = get_forward_context().no_compile_layers[layer_name]
    served, index = pages.served, pages.index
    rings, step = served.step_rings
    attention = served.model.layers[index].self_attn
    output.copy_(step.attend(attention, rings[index], q, k, v, served.config.decoder_windows[index]))


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


class PagedStep(Step):
    """A KVM engine step as the traced forward sees it, the engine's kind of `Step`: its tokens are flat already,
    their rotary positions vLLM's, and the layers' token shifts and attention go to the operators above, which find
    the step's requests and pages through vLLM's forward context (the cache layers here are the `StatePages`, whose
    names the operators take); `positions` are vLLM's token positions."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def rotary_positions(self, position_ids: torch.Tensor | None) -> torch.Tensor:
        return self.positions

    def token_shift(self, x: torch.Tensor, mix: torch.Tensor, cache_layer, name: str, first: str) -> torch.Tensor:
        output = torch.empty_like(x)
        torch.ops.kvm_maglev.token_shift(x, mix, self.positions, output, cache_layer.prefix, name, first)
        return output

    def attend(self, attention, cache_layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               gate: torch.Tensor | None) -> torch.Tensor:
        output = v.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        torch.ops.kvm_maglev.attention(q, k, v, gate, self.positions, output, cache_layer.prefix)
        return output


class PagedRing:
    """A Maglev layer's ring in a compiled decoding step, in place of its cache layer: its pages' name, by which
    `kvm_maglev::ring_attention` finds them (and the step's rings over the pages, `step_rings` of the served model)
    through vLLM's forward context, so that no page is an input of the graph."""

    def __init__(self, layer_name: str) -> None:
        self.prefix = layer_name


class PagedDecodeStep(TokenStep):
    """A Maglev decoding step in a compiled engine step, the engine's kind of the model's `TokenStep`: the model's
    prepared step (its positions and masks, which the graph reads), whose attention goes to
    `kvm_maglev::ring_attention` over the layer's `PagedRing`."""

    def __init__(self, step: TokenStep) -> None:
        self.__dict__.update(vars(step))  # the prepared step's plan, as it is

    def attend(self, attention, cache_layer: PagedRing, q, k, v, window: int) -> torch.Tensor:
        output = torch.empty_like(q)
        torch.ops.kvm_maglev.ring_attention(q, k, v, output, cache_layer.prefix)
        return output
