"""The decoding attention's pages read in place, a request at a time, on CPU: the speed-up of reading an engine's
pages for one token per request, whose reference gathers every request's keys and values into one batch first
(KVM's `state_window_attention_torch`, Maglev's `MaglevAttention.attend_token` over a ring bound to the pages).
Each request's reads stop at its last visible slot (the batch's reach is its longest request's), and nothing is
copied. Which of the two a layer call takes is `reads_in_place`'s choice, by how many bytes a request reads; both
give the same result (tests/vllm/test_engine_decode.py) and the crossing is measured by
`python -m kvm_maglev.benchmarks.engine_attention` (docs/serving.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvm_maglev.models.kvm.decode_attention_kvm import at_least_float32
from kvm_maglev.models.maglev.cache_maglev import TokenStep

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
    """How far each request of a decoding step reads its pages, on the host (`row_reads`), for reading them a
    request at a time: its page, its live state slots, its ring slots up to its last visible one, and whether a slot
    before that one is hidden (only then are its logits masked)."""

    pages: list[int]
    state: list[int]
    ring: list[int]
    masked: list[int]


def row_reads(page: torch.Tensor, state_slots: torch.Tensor, window_visible: torch.Tensor,
              state_capacity: int) -> RowReads:
    """`RowReads` of requests on pages `page` [B] with `state_slots` [B] live state slots (at most `state_capacity`
    read) and ring slots `window_visible` [B, W] visible: one transfer to the host for all of them."""
    ring_slot = torch.arange(1, window_visible.shape[1] + 1, device=page.device)
    ring = (ring_slot * window_visible).amax(1)
    masked = window_visible.sum(1) != ring  # some slot before the last visible one is hidden
    return RowReads(*torch.stack([page, state_slots.clamp(max=state_capacity), ring, masked]).tolist())


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
    for row, (index, live, seen, masked) in enumerate(zip(reads.pages, reads.state, reads.ring, reads.masked)):
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
    for row, (page, seen, masked) in enumerate(zip(reads.pages, reads.ring, reads.masked)):
        logits = torch.cat([torch.bmm(queries[row], at_least_float32(keys_t[page].narrow(-1, 0, seen))),
                            aside_logits[row]], -1)
        if masked:
            logits[..., :seen].masked_fill_(hidden[row, ..., :seen], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[row] = (torch.bmm(probs[..., :-1], at_least_float32(values[page].narrow(1, 0, seen)))
                    + probs[..., -1:] * aside_values[row])
    return out.to(q.dtype).view(batch, heads, 1, -1)


class PagedTokenStep(TokenStep):
    """The model's step of one token per row over rings bound to an engine's pages (the cache
    `page_caches.maglev_cache_over_pages` makes: a decoding step, and each step of a recurrent prompt): a layer
    whose ring a request reads enough of reads it in place (`attend_ring_in_place`), the others as the model does."""

    def __init__(self, step: TokenStep) -> None:
        self.__dict__.update(vars(step))  # the step's plan, as the cache made it
        # `ring_reads` of the step's rings, made by the first layer that reads a ring in place: the layers whose
        # rings share a `RingStep` (one window) and pages share them (one host transfer a step, not one a layer)
        self.reads: dict[tuple[int, int], RowReads] = {}

    def attend(self, attention, cache_layer, q, k, v, window: int) -> torch.Tensor:
        if not reads_in_place(q, cache_layer.tensors["keys"], cache_layer.tensors["values"]):
            return super().attend(attention, cache_layer, q, k, v, window)
        key = (id(cache_layer.step), id(cache_layer.index))
        if key not in self.reads:
            self.reads[key] = ring_reads(cache_layer)
        return attend_ring_in_place(q, k, v, cache_layer, self.reads[key])
