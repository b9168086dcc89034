"""KVM's decoding engine step on vLLM at the engine's cost: when every scheduled request reads one token (the serving
steady state), the step is described once by an `EngineDecode` (vLLM's positions and page indices, the host facts
the step needs), and each layer's operator launches one function over the pages: `decode_shift` (a token shift) or
`decode_attention` (the ring write and the state-and-window attention in one softmax). Both read everything that
depends on the schedule - ring slots, visible slots, live state slots - from the positions tensor, so no operator
runs Python over requests and no layer builds geometry. Each function also has a compiled form (`torch.compile`,
dynamic shapes) of its reads and arithmetic, equal to it and far fewer aten calls; the writes into the pages stay
eager (one `index_put_` each).

The compiled forms compile in vLLM's warm-up run, before any request (`VllmKVMForCausalLM.warm_up_shift`,
`.warm_up_attention`), on inputs of the kinds a served step gives them: scratch pages laid out as vLLM binds its
pages (`scratch_pages`), activations packed (`packed`) and made under the serving step's inference mode, at least 2
requests (dynamo specialises sizes 0 and 1: a step of one request runs eagerly). While serving they run under
`SERVING_STANCE`, which runs a step eagerly rather than compile a graph should a guard ever fail.

The model's own decoding step (`KVMModel.decoding_step`, `DecodeStep.token_shift`, `KVMAttention.attend_decoding`
over a `kvm_cache_over_pages` cache) is the reference they equal (tests/vllm/test_engine_decode.py); a step whose
requests fold a block into their state (once a chunk per request) runs its folds through that path first.

One difference from that reference: a request's first chunk enters its state pages late. The model writes each
first-chunk token's state slot as it reads it; no attention reads those slots before the request's token at
position `window_size` (until then its state holds no live slot), and until that token the ring still holds the
whole first chunk. So the engine writes them from the ring in the step whose tokens reach that position
(`enter_first_chunks`, for every kind of step, rare: once a request), not in every decoding step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import TypeVar

import torch
import torch.fx.experimental._config as shape_config

from kvm_maglev.models.kvm.cache_kvm import READ, STATE
from kvm_maglev.models.kvm.configuration_kvm import KVMConfig
from kvm_maglev.models.kvm.decode_attention_kvm import state_window_attention_torch
from kvm_maglev.models.kvm.decode_step_kvm import rows_folding, visible_ring
from kvm_maglev.models.kvm.state_kvm import slots_after_folds
from kvm_maglev.vllm import paged_attention_cpu
from kvm_maglev.vllm.in_place_reads import (
    RowReads,
    reads_in_place,
    row_reads,
    state_window_attention_by_page,
    state_window_attention_kernel,
)
from kvm_maglev.vllm.page_caches import kvm_cache_over_pages, step_page_indices

# how the compiled forms run while serving: a step whose inputs no start-up graph fits runs eagerly (the same
# result) instead of compiling; the test of serving sets "fail_on_recompile", so that such a step fails it
SERVING_STANCE = "eager_on_recompile"
MIN_COMPILED_ROWS = 2  # dynamo specialises sizes 0 and 1: a graph for them would not serve the other sizes
T = TypeVar("T")


def inference_dispatch_keys() -> tuple:
    """The dispatch keys a served step's operators run under: inference mode's, outside any operator."""
    with torch.inference_mode():
        return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


SERVED_KEYS = inference_dispatch_keys()


WARM_UP_GRAPHS = 64  # graphs of one function a process may hold: one per kind of step, for every model it serves


@contextmanager
def warming_up() -> Iterator[None]:
    """How the warm-up compiles: under a served step's dispatch state (vLLM's warm-up run calls the operators from
    inside its compilation's dispatch, functionalization and others excluded, and the graphs' guards on their
    inputs' dispatch keys are taken relative to that state, so graphs compiled there would not serve), without
    autograd, and with room for the graphs of every model a process serves (dynamo's default limit of 8 graphs a
    function, with fullgraph an error, is reached by a process serving two KVM models)."""
    with (torch._C._ForceDispatchKeyGuard(*SERVED_KEYS), torch.no_grad(),
          torch._dynamo.config.patch(recompile_limit=WARM_UP_GRAPHS)):
        yield


def state_slot_table(config: KVMConfig, max_len: int) -> torch.Tensor:
    """[blocks]: the live state slots of a token at chunk `window_chunks + b` (b blocks folded), for any position
    below `max_len` (`decode_step`'s table, made once for the engine)."""
    return torch.tensor(slots_after_folds(config, max(0, max_len // config.chunk_size - config.window_chunks)))


def reach(config: KVMConfig, table: list[int], seen: list[int]) -> tuple[int, int, int]:
    """How many leading state, window-ring and sliding-ring slots any row at `seen` reads (as `decode_step`'s
    `reach`), at least 2 each: a dynamic graph specialises sizes 0 and 1, and the masks hide the extra slots."""
    chunk, window_chunks = config.chunk_size, config.window_chunks
    blocks = [p // chunk - window_chunks for p in seen]
    state = max(table[block] if block >= 0 else 0 for block in blocks)
    top = max(seen) + 1
    return max(2, state), max(2, min(config.window_size, top)), max(2, min(config.sliding_window_size, top))


@dataclass
class EngineDecode:
    """An engine step in which each of `count` requests reads one token at position `seen[r]` > 0: token r is
    request r's; `positions` is vLLM's positions tensor, `pages[i]` layer i's page of each request ([count], int64,
    contiguous: the graphs compiled at start-up read that kind of tensor); `reach` (state, window, sliding) as
    `reach` gives it."""

    count: int
    seen: list[int]
    positions: torch.Tensor
    pages: list[torch.Tensor]
    reach: tuple[int, int, int]
    shared: dict = field(default_factory=dict, repr=False)  # what `once` made for the step's layers

    def once(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()` as the first layer that asks for `key` made it in this step: what depends on the step's
        schedule and not on a layer's weights (ring slots, visible slots, the rows' read extents) is made once per
        step, not once per layer."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]


def engine_decode(config: KVMConfig, table: list[int], first, pages: list[torch.Tensor],
                  positions: torch.Tensor) -> EngineDecode | None:
    """The `EngineDecode` of a step whose layer metadata `first` (vLLM's linear-attention metadata of the first
    state layer) schedules only decoding requests, each past its first token; else None (the general path)."""
    if first.num_prefills or not first.num_decodes:
        return None
    count = first.num_decodes
    seen = positions[:count].tolist()
    if not all(seen):  # a one-token prompt starts its request on pages another request may have used
        return None
    # new int64 tensors of this step, as the warm-up's page indices are (the graphs compiled there guard on that)
    return EngineDecode(count, seen, positions, step_page_indices(pages, count), reach(config, table, seen))


def fold_due(model, named_pages: list[dict[str, torch.Tensor]], decode: EngineDecode) -> None:
    """The folds of the blocks leaving the window of the rows that cross a chunk boundary with this step's token,
    by the model's own decoding step over the pages (rare: once a chunk per request)."""
    if not rows_folding(model.config, decode.seen):
        return
    cache = kvm_cache_over_pages(model.config, named_pages, decode.pages, decode.seen)
    model.decoding_step(cache, decode.seen, decode.positions.device)


def first_chunks_due(config: KVMConfig, starts: list[int], counts: list[int]) -> list[int]:
    """The requests (indices) that read tokens before this step and whose tokens this step, `counts[r]` from
    position `starts[r]`, include position `window_size`: the first whose attention reads the state, and the last
    step before which the ring holds the first chunk (a request new in the step reads its first chunk in it)."""
    window = config.window_size
    return [row for row, (start, count) in enumerate(zip(starts, counts)) if 0 < start <= window < start + count]


def enter_first_chunks(model, named_pages: list[dict[str, torch.Tensor]], pages: list[torch.Tensor],
                       starts: list[int], counts: list[int]) -> None:
    """The first-chunk state slots (STATE and READ) of the requests `first_chunks_due`, computed from their rings as
    `KVMAttention.first_chunk_entries` computes them from the tokens' keys, values and merge gates (the ring holds
    those as the attention received them): the slots of the tokens they read before this step, on every KVM
    layer. A token of this step in the first chunk is entered by the model's own path, which reads it."""
    rows = first_chunks_due(model.config, starts, counts)
    if not rows:
        return
    chunk = model.config.chunk_size
    for layer, layer_pages, layer_page in zip(model.layers, named_pages, pages):
        if layer.sliding:
            continue
        for row in rows:
            page, read = layer_page[row], min(starts[row], chunk)
            ring = [layer_pages[name][page, :, :read].transpose(0, 1) if name in layer_pages else None
                    for name in ("window_keys", "window_values", "window_gates")]
            entries = layer.self_attn.first_chunk_entries(*ring, slice(None))
            for name, entry in zip(STATE + READ, entries):
                layer_pages[name][page, :, :read] = entry.transpose(0, 1).to(layer_pages[name].dtype)


def shift_tokens(x: torch.Tensor, mix: torch.Tensor, carry: torch.Tensor, page: torch.Tensor, count: int,
                 output: torch.Tensor) -> None:
    """Token shift of one stream over a decoding step's tokens x [1, tokens, D] into `output` (zeros past
    `count`): each token's predecessor is its request's carry [pages, D] (as `DecodeStep.token_shift`); `page`
    [count] each request's page. The carries are left as they are (`decode_shift` writes them)."""
    new = x[:, :count]
    output[:, :count] = new + mix * (carry[page].to(x.dtype)[None] - new)
    output[:, count:] = 0


def decode_shift(x: torch.Tensor, mix: torch.Tensor, carry: torch.Tensor, page: torch.Tensor, count: int,
                 output: torch.Tensor, compiled: bool = False,
                 shift_rows: paged_attention_cpu.ShiftRows | None = None) -> None:
    """`shift_tokens` (compiled or not), then each request's token into its carry; eagerly, both in one call of the
    CPU kernel where it runs (`paged_attention_cpu.shift_tokens`; `shift_rows`: the step's `ShiftRows.decoding` of
    `page`, made once for its layers, else here). The write stays eager, as do the attention's page writes: a
    compiled graph writes a view of vLLM's page buffer by copying the whole view (tens of milliseconds a write at the
    benchmark's pages)."""
    if not compiled and paged_attention_cpu.shifts_tokens(x, mix, carry, output):
        shift_rows = shift_rows or paged_attention_cpu.ShiftRows.decoding(page)
        paged_attention_cpu.shift_tokens(x, mix, carry, shift_rows, "first", output)
        return
    (compiled_shift if compiled else shift_tokens)(x, mix, carry, page, count, output)
    carry[page] = x[0, :count].to(carry.dtype)


def write_slots(tensor: torch.Tensor, page: torch.Tensor, slot: torch.Tensor, values: torch.Tensor) -> None:
    """Slot `slot[r]` of page `page[r]` of `tensor` [pages, heads, slots, d] set to `values[r]` [heads, d]."""
    tensor[page, :, slot] = values.to(tensor.dtype)


def state_window_attention_as_sums(q: torch.Tensor, page: torch.Tensor, state_keys: torch.Tensor,
                                   state_values: torch.Tensor, state_slots: torch.Tensor, window_keys: torch.Tensor,
                                   window_values: torch.Tensor, window_visible: torch.Tensor,
                                   state_temperature: torch.Tensor | None, window_temperature: torch.Tensor | None,
                                   scale: float) -> torch.Tensor:
    """`state_window_attention_torch` (its arguments, its result) written as sums of products over each request's
    page rather than as batched matrix products: compiled (inductor), the page indexing becomes indirect loads
    inside the reduction loops, so no request's keys or values are copied and the layer's attention is one compiled
    call. The softmax over both segments is taken by hand (one maximum, one denominator), in at least float32."""
    batch, heads, dim = q.shape
    kv_heads, capacity = state_keys.shape[1], state_keys.shape[2]
    groups = heads // kv_heads
    wide = torch.promote_types(q.dtype, torch.float32)
    queries = q.to(wide).view(batch, kv_heads, groups, 1, dim)
    live = torch.arange(capacity, device=q.device) < state_slots[:, None]
    segments = [segment for segment in ((state_keys, state_values, live, state_temperature),
                                        (window_keys, window_values, window_visible, window_temperature))
                if segment[0].shape[2]]  # a sliding-window layer reads no state
    logits = []
    for keys, _, visible, temperature in segments:
        scores = (queries * keys[page].to(wide)[:, :, None]).sum(-1)  # [B, Hkv, groups, slots]
        if temperature is not None:
            scores = scores * temperature.view(kv_heads, groups, 1).to(wide)
        logits.append((scores * scale).masked_fill(~visible[:, None, None], float("-inf")))
    top = torch.stack([segment.amax(-1) for segment in logits]).amax(0)[..., None]
    weights = [(segment - top).exp() for segment in logits]
    total = sum(weight.sum(-1, keepdim=True) for weight in weights)
    out = sum((weight[..., None] * segment[1][page].to(wide)[:, :, None]).sum(-2)
              for weight, segment in zip(weights, segments)) / total
    return out.to(window_values.dtype).view(batch, heads, -1)


def decode_geometry(config: KVMConfig, position: torch.Tensor,
                    table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What decoding tokens at `position` [count] see on a layer once they are written: the ring slots visible to
    each [count, ring size] and its live state slots [count] (none on a sliding-window layer: `table` None)."""
    if table is None:
        size = config.sliding_window_size
        return visible_ring(position, size, position - size + 1), position * 0
    chunk = config.chunk_size
    block = torch.div(position, chunk, rounding_mode="floor") - config.window_chunks
    visible = visible_ring(position, config.window_size, (block + 1).clamp(min=0) * chunk)
    return visible, torch.where(block < 0, 0, table[block.clamp(min=0)])


def attend_pages(attention, q: torch.Tensor, positions: torch.Tensor, page: torch.Tensor, count: int,
                 output: torch.Tensor, pages: dict[str, torch.Tensor], table: torch.Tensor | None,
                 state_reach: int, window_reach: int,
                 geometry: tuple[torch.Tensor, torch.Tensor, RowReads | None] | None = None) -> None:
    """Each request's query over its live state slots and visible ring slots, in one softmax, into `output` (zeros
    past `count`), the step's tokens already in the pages (as `attend_decoding` reads them after its writes).
    `geometry`: the step's `decode_geometry` cut to the reaches and its `RowReads` (the eager step's, made once per
    step, `layer_geometry`); else made here (the compiled form)."""
    if table is None:  # a sliding-window layer
        read_keys, read_values = pages["window_keys"][:, :, :0], pages["window_values"][:, :, :0]
        temperatures = (None, None)
    else:
        read_keys, read_values = pages["read_keys"][:, :, :state_reach], pages["read_values"][:, :, :state_reach]
        temperatures = (attention.temperature("state_temperature"), attention.temperature("window_temperature"))
    if geometry is None:
        visible, state_slots = decode_geometry(attention.config, positions[:count], table)
        geometry = visible[:, :window_reach], state_slots, None
    visible, state_slots, reads = geometry
    window_keys, window_values = pages["window_keys"][:, :, :window_reach], pages["window_values"][:, :, :window_reach]
    inputs = (q[:count], page, read_keys, read_values, state_slots, window_keys, window_values, visible,
              *temperatures, q.shape[-1] ** -0.5)
    if torch.compiler.is_compiling():
        output[:count] = state_window_attention_as_sums(*inputs)
    elif paged_attention_cpu.reads(q, read_keys, read_values, window_keys, window_values):
        output[:count] = state_window_attention_kernel(*inputs, reads=reads)
    elif reads_in_place(q, read_keys, read_values, window_keys, window_values):
        output[:count] = state_window_attention_by_page(*inputs, reads=reads)
    else:
        output[:count] = state_window_attention_torch(*inputs)
    output[count:] = 0


def layer_geometry(config: KVMConfig, decode: EngineDecode, page: torch.Tensor, table: torch.Tensor | None,
                   state_reach: int, window_reach: int) -> tuple[torch.Tensor, torch.Tensor, RowReads]:
    """`attend_pages`' geometry of an eager step's layers of one kind (`table` None: sliding window) on pages
    `page`: made by the first such layer of the step, shared by the others."""
    def make() -> tuple[torch.Tensor, torch.Tensor, RowReads]:
        visible, state_slots = decode_geometry(config, decode.positions[:decode.count], table)
        visible = visible[:, :window_reach]
        return visible, state_slots, row_reads(page, state_slots, visible, 0 if table is None else state_reach)
    return decode.once(("geometry", table is None, id(page)), make)


def decode_attention(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                     decode: EngineDecode, page: torch.Tensor, output: torch.Tensor, pages: dict[str, torch.Tensor],
                     table: torch.Tensor | None, compiled: bool) -> None:
    """Layer `attention`'s decoding step into `output` (zeros past the step's tokens): each request's token
    written into its ring slot (a first-chunk token's state slot later, `enter_first_chunks`), then its query over
    its live state slots and visible ring slots in one softmax - `KVMAttention.attend_decoding` or
    `KVMSlidingWindowAttention.attend_decoding` over the pages. `page` [count]: each request's page; `table`:
    `state_slot_table` on the positions' device (None for a sliding-window layer); `compiled`: the tensor work in
    compiled graphs."""
    count, positions = decode.count, decode.positions
    sliding = table is None
    config = attention.config
    if k.shape[0] != count:  # vLLM's padding
        k, v, gate = k[:count], v[:count], None if gate is None else gate[:count]
    size = config.sliding_window_size if sliding else config.window_size
    slot = decode.once(("slot", size), lambda: positions[:count] % size)
    for name, new in (("window_keys", k), ("window_values", v), ("window_gates", gate)):
        if name in pages and new is not None:
            write_slots(pages[name], page, slot, new)
    state_reach, window_reach, sliding_reach = decode.reach
    window_reach = sliding_reach if sliding else window_reach
    if compiled:
        compiled_attend(attention, q, positions, page, count, output, pages, table, state_reach, window_reach)
    else:
        attend_pages(attention, q, positions, page, count, output, pages, table, state_reach, window_reach,
                     layer_geometry(config, decode, page, table, state_reach, window_reach))


def packed(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` with the strides of a new contiguous tensor, copied only when it has others: `contiguous()` keeps
    any stride of a size-1 dimension, and the compiled graphs guard on strides."""
    if tensor is None:
        return None
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    return tensor if tensor.stride() == tuple(reversed(strides)) else tensor.clone(memory_format=torch.contiguous_format)


def scratch_pages(layout: list[list[tuple]], pages: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's page tensors (`layout`: `kvm.page_layout`) over `pages` zeroed scratch pages, laid out as vLLM
    binds a state layer's pages (`MambaBase.bind_kv_cache`: one byte row a page, padded to the largest layer's, each
    tensor a view into it) and made outside inference mode, as vLLM allocates them: a graph compiled over these
    serves vLLM's pages. The layers share the rows (what the warm-up writes is never read)."""
    sizes = [sum(prod(shape) * dtype.itemsize for _, shape, dtype in layer) for layer in layout]
    with torch.inference_mode(False):
        rows = torch.zeros(pages, max(sizes), dtype=torch.int8, device=device)
        tensors = []
        for layer in layout:
            views, offset = [], 0
            for _, shape, dtype in layer:
                end = offset + prod(shape) * dtype.itemsize
                views.append(rows[:, offset:end].view(dtype).view(-1, *shape))
                offset = end
            tensors.append(tuple(views))
    return tensors


def warm_up_positions(config: KVMConfig, max_len: int, rows: int) -> list[list[int]]:
    """The positions of `rows` requests in each warm-up step of an attention: all at the start (in their first
    chunk: every reach below its page's size), one just past the window (the window reached whole, the state not)
    and one at `max_len` (both whole). A graph's slices of the pages are contiguous or not by whether a reach is
    its page's size, a guard each: these are the cases a served request meets."""
    first = list(range(1, rows))
    return [first + [rows]] + [first + [position] for position in (config.window_size + 1, max_len - 1)
                               if rows < position < max_len]


def compiled(function):
    """`function` compiled with dynamic shapes (one graph for every batch size and reach), its sizes not
    duck-shaped: two sizes that happen to be equal when it compiles (4 heads, 4 requests) do not become a guard
    that a later step fails, compiling again while serving."""
    graph = torch.compile(function, dynamic=True, fullgraph=True)

    def run(*args, **kwargs):
        with shape_config.patch(use_duck_shape=False):
            return graph(*args, **kwargs)
    return run


compiled_shift = compiled(shift_tokens)
compiled_attend = compiled(attend_pages)
