"""The decoding attention's pages read in place on CPU: the speed-ups of reading an engine's pages for one token per
request, whose reference gathers every request's keys and values into one batch first (KVM's
`state_window_attention_torch`, Maglev's `MaglevAttention.attend_token` over a ring bound to the pages). Each
request's reads stop at its last visible slot (the batch's reach is its longest request's), and nothing is copied.
Two forms: one call of the compiled CPU kernel for every request (`paged_attention_cpu`, where it built), else a
request at a time in torch when a request reads at least `IN_PLACE_MIN_BYTES` (`reads_in_place`; below, gathering
costs less). All give the same result (tests/vllm/test_engine_decode.py, tests/models/kvm/test_paged_attention_cpu.py)
and are timed by `python -m kvm_maglev.benchmarks.engine_attention` (docs/serving.md)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvm_maglev.models.kvm.decode_attention_kvm import at_least_float32
from kvm_maglev.models.maglev.cache_maglev import TokenStep
from kvm_maglev.vllm import paged_attention_cpu
from kvm_maglev.vllm.paged_attention_cpu import PagedSegment, attend_segments

# bytes of keys and values a request's attention reads from its pages, from which reading them in place request by
# request costs less on CPU than gathering every request's into one batch (`reads_in_place`; the crossing measured
# by benchmarks/engine_attention.py's early-decoding cases, docs/serving.md)
IN_PLACE_MIN_BYTES = 64 * 1024


def reads_in_place(q: torch.Tensor, *pages: torch.Tensor) -> bool:
    """Whether a decoding attention reads each request's pages in place (KVM's `state_window_attention_by_page`,
    Maglev's `attend_ring_in_place`) rather than gathering them: on CPU, outside compiled graphs, when a request
    reads at least `IN_PLACE_MIN_BYTES` of `pages` (the key and value tensors it reads, [pages, ...]; a gather copies
    them all, a request at a time costs a few operator calls each)."""
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    per_request = sum(tensor[0].numel() * tensor.element_size() for tensor in pages)
    return per_request >= IN_PLACE_MIN_BYTES


@dataclass
class RowReads:
    """How far each request of a decoding step reads its pages (`row_reads`), for reading them where they lie:
    `extents` [4, requests] int64, rows: its page, its live state slots read, its ring slots up to its last visible
    one, and whether a slot before that one is hidden (only then are its logits masked). The kernel reads the rows
    as tensors; the loop a request at a time reads them on the host (`rows`: one transfer)."""

    extents: torch.Tensor

    @functools.cached_property
    def rows(self) -> list[tuple[int, int, int, int]]:
        return list(zip(*self.extents.tolist()))


def row_reads(page: torch.Tensor, state_slots: torch.Tensor, window_visible: torch.Tensor,
              state_capacity: int) -> RowReads:
    """`RowReads` of requests on pages `page` [B] with `state_slots` [B] live state slots (at most `state_capacity`
    read) and ring slots `window_visible` [B, W] visible."""
    ring_slot = torch.arange(1, window_visible.shape[1] + 1, device=page.device)
    ring = (ring_slot * window_visible).amax(1)
    masked = window_visible.sum(1) != ring  # some slot before the last visible one is hidden
    return RowReads(torch.stack([page, state_slots.clamp(max=state_capacity), ring, masked]).to(torch.int64))


def state_window_attention_by_page(q: torch.Tensor, page: torch.Tensor, state_keys: torch.Tensor,
                                   state_values: torch.Tensor, state_slots: torch.Tensor, window_keys: torch.Tensor,
                                   window_values: torch.Tensor, window_visible: torch.Tensor,
                                   state_temperature: torch.Tensor | None, window_temperature: torch.Tensor | None,
                                   scale: float, reads: RowReads | None = None) -> torch.Tensor:
    """`state_window_attention_torch` (its arguments, its result) reading each request's page of the page tensors
    in place, one request at a time, instead of gathering every request's into one batch, and only as far as the
    request reads (`reads`, from the masks when not given): its live state slots and its ring up to the last
    visible slot (the batch's reach is its longest request's). The same products and softmax per request, in at
    least float32; what is the same for every request (the scale, the temperatures) applied once for all."""
    batch, heads, dim = q.shape
    kv_heads = state_keys.shape[1]
    reads = reads or row_reads(page, state_slots, window_visible, state_keys.shape[2])
    wide = torch.promote_types(q.dtype, torch.float32)
    queries = (q.to(wide) * scale).view(batch, kv_heads, heads // kv_heads, dim)
    state_queries, window_queries = (queries if temperature is None else queries * temperature.view(kv_heads, -1, 1).to(wide)
                                     for temperature in (state_temperature, window_temperature))
    window_keys_t = window_keys.transpose(-1, -2)  # [pages, Hkv, D, W]: a view
    out = torch.empty(batch, kv_heads, heads // kv_heads, window_values.shape[-1], dtype=wide, device=q.device)
    for row, (index, live, seen, masked) in enumerate(reads.rows):
        logits = torch.bmm(window_queries[row], at_least_float32(window_keys_t[index].narrow(-1, 0, seen)))
        if masked:
            logits.masked_fill_(~window_visible[row, :seen], float("-inf"))
        values = at_least_float32(window_values[index].narrow(1, 0, seen))
        if not live:
            torch.bmm(torch.softmax(logits, dim=-1), values, out=out[row])
            continue
        state = torch.bmm(state_queries[row], at_least_float32(state_keys[index].narrow(1, 0, live)).transpose(-1, -2))
        probs = torch.softmax(torch.cat([state, logits], dim=-1), dim=-1)
        out[row] = (torch.bmm(probs[..., :live], at_least_float32(state_values[index].narrow(1, 0, live)))
                    + torch.bmm(probs[..., live:], values))
    return out.to(window_values.dtype).view(batch, heads, -1)


def head_scales(heads: int, scale: float, temperature: torch.Tensor | None) -> torch.Tensor:
    """Each query head's factor on its logits, [heads] float32: the softmax scale, times the head's temperature."""
    if temperature is None:
        return torch.full((heads,), scale, dtype=torch.float32)
    return (temperature.to(torch.float32) * scale).reshape(heads).contiguous()


def state_window_attention_kernel(q: torch.Tensor, page: torch.Tensor, state_keys: torch.Tensor,
                                  state_values: torch.Tensor, state_slots: torch.Tensor, window_keys: torch.Tensor,
                                  window_values: torch.Tensor, window_visible: torch.Tensor,
                                  state_temperature: torch.Tensor | None, window_temperature: torch.Tensor | None,
                                  scale: float, reads: RowReads | None = None) -> torch.Tensor:
    """`state_window_attention_torch` (its arguments, its result) as one call of the CPU kernel
    (`paged_attention_cpu`): each request's live state slots and its ring up to its last visible slot (`reads`, from
    the masks when not given), read where they lie, one softmax."""
    reads = reads or row_reads(page, state_slots, window_visible, state_keys.shape[2])
    heads = q.shape[1]
    pages = reads.extents[0]
    segments = [PagedSegment(window_keys, window_values, pages, reads.extents[2], window_visible,
                             head_scales(heads, scale, window_temperature))]
    if state_keys.shape[2]:  # a sliding-window layer reads no state
        segments.insert(0, PagedSegment(state_keys, state_values, pages, reads.extents[1], None,
                                        head_scales(heads, scale, state_temperature)))
    return attend_segments(q, segments).to(window_values.dtype)


def ring_reads(ring) -> RowReads:
    """`RowReads` of the requests of `ring`'s step (a MaglevCacheLayer over an engine's pages, its `RingStep` made):
    each request's page and its ring slots up to the last one its token sees."""
    step = ring.step
    pages = ring.index if step.rows is None else ring.index[step.rows]
    return row_reads(pages, pages * 0, step.mask[:, 0, 0, :ring.tensors["keys"].shape[2]], 0)


def attend_ring_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring,
                         reads: RowReads | None = None) -> torch.Tensor:
    """`MaglevAttention.attend_token` (its inputs, its result) over a ring whose rows are an engine's pages (`ring`:
    a MaglevCacheLayer over them, its `RingStep` made), the token written as it writes it and then each request's
    ring read in place, up to its last visible slot (`reads`: `ring_reads`, made here when not given), instead of
    gathering every request's whole ring: the ring's logits and the set-aside key's, the ring step's mask, one
    softmax, in at least float32."""
    step = ring.step
    aside_keys, aside_values = ring.write_slots(k[:, :, 0], v[:, :, 0], step)  # [B, Hkv, D]
    keys, values = ring.tensors["keys"], ring.tensors["values"]
    batch, heads, _, dim = q.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    queries = (q.to(wide) * dim ** -0.5).view(batch, kv_heads, heads // kv_heads, dim)
    hidden = ~step.mask  # [B, 1, 1, capacity + 1]
    aside_logits = torch.matmul(queries, at_least_float32(aside_keys)[..., None])  # [B, Hkv, groups, 1]
    aside_logits.masked_fill_(hidden[..., capacity:], float("-inf"))
    aside_values = at_least_float32(aside_values)[:, :, None]
    reads = reads or ring_reads(ring)
    keys_t = keys.transpose(-1, -2)  # [pages, Hkv, D, capacity]: a view
    out = torch.empty(batch, kv_heads, heads // kv_heads, values.shape[-1], dtype=wide, device=q.device)
    for row, (page, _, seen, masked) in enumerate(reads.rows):
        logits = torch.cat([torch.bmm(queries[row], at_least_float32(keys_t[page].narrow(-1, 0, seen))),
                            aside_logits[row]], -1)
        if masked:
            logits[..., :seen].masked_fill_(hidden[row, ..., :seen], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[row] = (torch.bmm(probs[..., :-1], at_least_float32(values[page].narrow(1, 0, seen)))
                    + probs[..., -1:] * aside_values[row])
    return out.to(q.dtype).view(batch, heads, 1, -1)


def attend_ring_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring,
                       reads: RowReads | None = None) -> torch.Tensor:
    """`attend_ring_in_place` (its inputs, its result) as one call of the CPU kernel (`paged_attention_cpu`): the
    token written as the model writes it, then each request's ring up to its last visible slot and its set-aside
    key (a segment of one slot, read where the ring step's mask shows it) in one softmax."""
    step = ring.step
    aside_keys, aside_values = ring.write_slots(k[:, :, 0], v[:, :, 0], step)  # [B, Hkv, D]
    keys, values = ring.tensors["keys"], ring.tensors["values"]
    batch, heads, _, dim = q.shape
    capacity = keys.shape[2]
    reads = reads or ring_reads(ring)
    visible = step.mask[:, 0, 0].contiguous()  # [B, capacity + 1]: the ring's slots, then the set-aside key
    scales = head_scales(heads, dim ** -0.5, None)
    aside = [tensor.to(keys.dtype)[:, :, None].contiguous() for tensor in (aside_keys, aside_values)]
    segments = [PagedSegment(keys, values, reads.extents[0], reads.extents[2], visible, scales),
                PagedSegment(*aside, torch.arange(batch), visible[:, capacity].to(torch.int64), None, scales)]
    return attend_segments(q[:, :, 0], segments).to(q.dtype).view(batch, heads, 1, -1)


class PagedTokenStep(TokenStep):
    """The model's step of one token per row over rings bound to an engine's pages (the cache
    `page_caches.maglev_cache_over_pages` makes: a decoding step, and each step of a recurrent prompt): every layer
    reads its rings in place by the CPU kernel where it runs (`attend_ring_kernel`); else a layer whose ring a request
    reads enough of, a request at a time (`attend_ring_in_place`), the others as the model does."""

    def __init__(self, step: TokenStep) -> None:
        self.__dict__.update(vars(step))  # the step's plan, as the cache made it
        # `ring_reads` of the step's rings, made by the first layer that reads a ring in place: the layers whose
        # rings share a `RingStep` (one window) and pages share them (made once a step, not once a layer)
        self.reads: dict[tuple[int, int], RowReads] = {}

    def attend(self, attention, cache_layer, q, k, v, window: int) -> torch.Tensor:
        keys, values = cache_layer.tensors["keys"], cache_layer.tensors["values"]
        kernel = paged_attention_cpu.reads(q, keys, values)
        if not kernel and not reads_in_place(q, keys, values):
            return super().attend(attention, cache_layer, q, k, v, window)
        key = (id(cache_layer.step), id(cache_layer.index))
        if key not in self.reads:
            self.reads[key] = ring_reads(cache_layer)
        return (attend_ring_kernel if kernel else attend_ring_in_place)(q, k, v, cache_layer, self.reads[key])
