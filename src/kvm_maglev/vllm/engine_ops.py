"""The operators at which vLLM's compiled graph of a KVM model splits, as it splits its own models at attention:
`kvm_maglev::token_shift` and `kvm_maglev::attention`, registered with torch.library; and Maglev's
`kvm_maglev::ring_attention`, the attention of a compiled decoding step over a layer's ring pages. The engine's
kinds of `Step` (`PagedStep`, `PagedDecodeStep`) launch them.

Everything that reads or writes a request's state - token-shift carries, window rings, the state and its folds -
depends on the step's schedule (which requests, at which positions, which of them cross a chunk boundary), so it
runs inside these operators, on what the served model builds once per engine step from vLLM's attention metadata:
when every request decodes, an `EngineDecode` over which each operator launches one function of decode_kvm
(with `COMPILE_DECODE`, compiled in vLLM's warm-up run, which these operators run too; eager for one request);
else the model's own kind of `Step` for the scheduled tokens (a `PromptStep`)
and a `KVMCache` over the pages, run eagerly. The traced forward runs on a `PagedStep`, the kind of `Step` whose token shifts and
attention launch these operators. Between them, projections, norms and feed-forwards are traced once and
compiled. No `from __future__ import annotations` here: torch.library reads the operators' signatures.
"""

import torch
from torch.library import Library
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

from kvm_maglev.models.common.step_plan import Step
from kvm_maglev.models.maglev.cache_maglev import TokenStep
from kvm_maglev.vllm import decode_kvm, paged_attention_cpu
from kvm_maglev.vllm.decode_kvm import EngineDecode, decode_attention, decode_shift, packed

LIBRARY = Library("kvm_maglev", "FRAGMENT")  # alive as long as the module: the operators' lifetime


def scheduled(layer_name: str, positions: torch.Tensor):
    """What the operator of the state pages named `layer_name` works on: its pages, the served model and the
    engine step's rows (`step_rows`: an `EngineDecode`, or the model's `Step`, its count of scheduled tokens and
    its cache over the pages; None in a run without requests). vLLM's forward context keeps every state layer by
    name."""
    pages = get_forward_context().no_compile_layers[layer_name]
    return pages, pages.served, pages.served.step_rows(positions)


def token_shift(x: torch.Tensor, mix: torch.Tensor, positions: torch.Tensor, output: torch.Tensor,
                layer_name: str, streams: str, first: str) -> None:
    """Token shift of layer `layer_name`'s streams `streams` (names joined by commas, consecutive in the layer's
    carries; x and mix hold their columns side by side) over the step's scheduled tokens, into `output` (zeros past
    them: vLLM's padding)."""
    pages, served, rows = scheduled(layer_name, positions)
    if isinstance(rows, EngineDecode):
        page, carry = rows.pages[pages.index], served.carry_columns(pages.index, streams)
        if served.runs_compiled(pages.index, streams, rows):
            # packed, as at start-up, where the graphs were compiled (no copy when they are); `mix` a copy: a
            # parameter where one stream is shifted, of another kind than the streams' concatenated mixes
            with torch.compiler.set_stance(decode_kvm.SERVING_STANCE):
                decode_shift(packed(x), mix.clone(), carry, page, rows.count, output, compiled=True)
        else:
            shift_rows = rows.once(("shift rows", id(page)), lambda: paged_attention_cpu.ShiftRows.decoding(page))
            decode_shift(x, mix, carry, page, rows.count, output, shift_rows=shift_rows)
        return
    if rows is None and served.compile_decode and (pages.index, streams) not in served.warmed:
        served.warm_up_shift(pages.index, streams, x, mix)  # vLLM's warm-up run
    if rows is None:
        output.zero_()
        return
    step, count, cache = rows
    layer = cache.layers[pages.index]
    carry = served.carry_columns(pages.index, streams)
    if layer.record is None and paged_attention_cpu.shifts_tokens(x, mix, carry, output):
        # every stream and request in one call of the CPU kernel (the loop below is its reference)
        shift_rows = step.tokens.once(("shift rows", id(layer.index)), lambda: paged_attention_cpu.ShiftRows(
            layer.index.to(torch.int64).contiguous(), step.tokens.offset, step.tokens.count, step.tokens.start))
        paged_attention_cpu.shift_tokens(x, mix, carry, shift_rows, first, output)
        return
    output[:, count:] = 0  # the scheduled tokens' columns are all written below
    begin = 0
    for name in streams.split(","):
        end = begin + cache.layers[pages.index].tensors[f"carry.{name}"].shape[-1]
        output[:, :count, begin:end] = step.token_shift(x[:, :count, begin:end], mix[..., begin:end],
                                                        cache.layers[pages.index], name, first)
        begin = end


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
              positions: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The attention of layer `layer_name` (window, state and its folds, pages updated) over the step's scheduled
    tokens, into `output` (zeros past them)."""
    pages, served, rows = scheduled(layer_name, positions)
    index = pages.index
    if isinstance(rows, EngineDecode):
        q, k, v, gate = (packed(t) for t in (q, k, v, gate))  # as at start-up
        layer = served.model.layers[index]
        arguments = (layer.self_attn, q, k, v, gate, rows, rows.pages[index], output, served.named_pages()[index],
                     None if layer.sliding else served.slot_table)
        if served.runs_compiled(index, "attention", rows):
            with torch.compiler.set_stance(decode_kvm.SERVING_STANCE):
                decode_attention(*arguments, compiled=True)
        else:
            decode_attention(*arguments, compiled=False)
        return
    if rows is None and served.compile_decode and (index, "attention") not in served.warmed:
        served.warm_up_attention(index, q, k, v, gate, positions)  # vLLM's warm-up run
    if rows is None:
        output.zero_()
        return
    step, count, cache = rows
    output[:count] = step.attend(served.model.layers[index].self_attn, cache.layers[index], q[:count], k[:count],
                                 v[:count], None if gate is None else gate[:count])
    output[count:] = 0


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """Maglev layer `layer_name`'s attention of one token per request over its ring pages, the token written into
    them (the step's `PagedTokenStep` over the step's rings: `MaglevAttention.attend_token`, large rings read in
    place), into `output`."""
    pages = get_forward_context().no_compile_layers[layer_name]
    served, index = pages.served, pages.index
    rings, step = served.step_rings
    attention = served.model.layers[index].self_attn
    output.copy_(step.attend(attention, rings[index], q, k, v, served.config.decoder_windows[index]))


def token_shift_fake(x, mix, positions, output, layer_name, streams, first) -> None:
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
        output = x.new_empty(x.shape)
        torch.ops.kvm_maglev.token_shift(x, mix, self.positions, output, cache_layer.prefix, name, first)
        return output

    def token_shifts(self, streams: list[tuple[torch.Tensor, torch.Tensor, str]], cache_layer,
                     first: str) -> list[torch.Tensor]:
        """The streams in one operator call: their columns side by side."""
        shifted = self.token_shift(torch.cat([x for x, _, _ in streams], dim=-1),
                                   torch.cat([mix.reshape(-1) for _, mix, _ in streams]), cache_layer,
                                   ",".join(name for _, _, name in streams), first)
        return list(shifted.split([x.shape[-1] for x, _, _ in streams], dim=-1))

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
