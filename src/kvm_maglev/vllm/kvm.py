"""KVM on vLLM: our model code, each request's state in vLLM's state pages.

Per decoder layer and request one page (a `MambaBase` layer, so vLLM's cache manager allocates it with the request
and frees it with it) holds what a `KVMCache` row holds for that layer:
- a KVM layer: its block window (keys, values and merge gates of the last `window_chunks` chunks, left-aligned),
  its state slots (key sums, value sums, value norms or counts), sized for `max_model_len` - exact for a fixed
  budget, the largest a request reaches for a growing one;
- a sliding-window layer: its last `sliding_window` keys and values;
- the layer's token-shift carries (the last token of each shifted stream), one vector.
How many of those entries are live (window span, state slots, blocks folded) follows from the request's position,
vLLM's token position, by the rules the cache itself follows; writing a page back checks them.

A forward gathers the scheduled requests' pages into a `KVMCache` (requests at the same position share one row
group), runs `KVMModel.forward` on it and writes the rows back, so chunked prefill continues a request exactly, and a
preempted request restarts at position 0 from a fresh state, as every new request does. Folds run at the chunk
boundary (`KVMAttention.paced_folds` off): a fold computed ahead would have to live in the page too, and it equals
the boundary's fold bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import VllmConfig

from kvm_maglev.models.kvm.cache_kvm import KVMCache, new_layer_cache
from kvm_maglev.models.kvm.step_plan import RowGroup
from kvm_maglev.models.kvm.configuration_kvm import KVMConfig
from kvm_maglev.models.kvm.modeling_kvm import KVMAttention, KVMForCausalLM, KVMModel
from kvm_maglev.models.kvm.onednn_linear import OneDNNLinear
from kvm_maglev.vllm.pages import PagedStateModel, ScheduledRows, page_layers


@dataclass
class PageLayout:
    """Where one layer's cache lives in its page: the first `window` entries are the window tensors, the next
    `state` (0 for a sliding-window layer) the state tensors, then one vector of the carries named `carries`."""

    sliding: bool
    window: int
    state: int
    carries: list[tuple[str, int]]  # (stream, width) in the order they sit in the carry vector


def window_span(config: KVMConfig, sliding: bool, seen: int) -> tuple[int, int]:
    """Absolute positions [begin, seen) a layer's window holds after `seen` tokens."""
    if sliding:
        return max(0, seen - config.sliding_window_size), seen
    chunk_index = (seen - 1) // config.chunk_size
    return max(0, chunk_index + 1 - config.window_chunks) * config.chunk_size, seen


def merged_blocks(config: KVMConfig, seen: int) -> int:
    """Blocks j >= 1 folded into a KVM layer's state after `seen` tokens (block j leaves the window when chunk
    j + window_chunks starts)."""
    return max(0, (seen - 1) // config.chunk_size - config.window_chunks)


def probe_cache(model: KVMModel) -> KVMCache:
    """The cache after one token: which tensors each layer keeps, in which dtypes and widths (the page layout is
    read off it, so it follows the model's code rather than a second list of its switches)."""
    with torch.no_grad():
        cache = KVMCache(model.config)
        device = model.embed_tokens.weight.device
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    return cache


class VllmKVMForCausalLM(PagedStateModel):
    """`KVMForCausalLM` for vLLM: our model and head, a `StatePages` per decoder layer."""

    MODEL_NAME = "KVM"
    # the state tensors one step's gather made (by id, the tensors kept alive so that ids stay theirs)
    gathered_states: dict[int, torch.Tensor] = {}
    PROMPT_EMBEDDINGS_REFUSED = "the plugin lays out each request's token ids; embeddings are not wired through"

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.build(vllm_config, KVMConfig, KVMModel, OneDNNLinear, "vocab_size")
        for module in self.model.modules():
            if isinstance(module, KVMAttention):
                module.paced_folds = False
        max_len = vllm_config.model_config.max_model_len
        self.layouts, shapes, dtypes = self.page_layouts(probe_cache(self.model), max_len)
        self.state_layers = page_layers(prefix, shapes, dtypes)

    def page_layouts(self, probe: KVMCache, max_len: int):
        """Each layer's `PageLayout` and its page's shapes and dtypes: windows at their widest, states at the
        largest length `max_len` tokens reach."""
        config = self.config
        state_slots = config.state_slots_after(max_len)
        layouts, shapes, dtypes = [], [], []
        for index, (layer, carries) in enumerate(zip(probe.groups[0].layers, probe.carries)):
            window = layer.window.live()
            width = config.sliding_window_size if layer.is_sliding else config.window_size
            layer_shapes = [(t.shape[1], width, t.shape[3]) for t in window]
            layer_dtypes = [t.dtype for t in window]
            state = [] if layer.is_sliding else list(layer.state())
            layer_shapes += [(t.shape[1], state_slots, t.shape[3]) for t in state]
            layer_dtypes += [t.dtype for t in state]
            streams = [(name, value.shape[-1]) for name, value in carries.values.items()]
            if streams:
                layer_shapes.append((sum(width for _, width in streams),))
                layer_dtypes.append(next(iter(carries.values.values())).dtype)
            layouts.append(PageLayout(layer.is_sliding, len(window), len(state), streams))
            shapes.append(layer_shapes)
            dtypes.append(layer_dtypes)
        return layouts, shapes, dtypes

    def gather(self, rows: ScheduledRows) -> KVMCache:
        """A KVMCache whose rows are the scheduled requests' pages: one row group per position; requests at
        position 0 start fresh."""
        cache = KVMCache(self.config)
        cache.rows = rows.positions.shape[0]
        by_position: dict[int, list[int]] = {}
        for row, position in enumerate(rows.positions.tolist()):
            by_position.setdefault(position, []).append(row)
        groups, self.gathered_states = [], {}
        for position, members in by_position.items():
            index = [pages[members] for pages in rows.pages]
            slots = self.config.state_slots_after(position)
            layers = [self.load_layer(i, position, index[i], slots) for i in range(self.config.num_hidden_layers)]
            groups.append(RowGroup(members, layers))
        cache.groups = sorted(groups, key=lambda group: group.rows[0])
        fresh = rows.fresh[:, None]
        for carries, layout, layer, index in zip(cache.carries, self.layouts, self.state_layers, rows.pages):
            if layout.carries:
                vector = torch.where(fresh, 0.0, layer.kv_cache[-1][index])
                parts = vector.split([width for _, width in layout.carries], dim=-1)
                carries.values = {name: part[:, None] for (name, _), part in zip(layout.carries, parts)}
        return cache

    def load_layer(self, layer_index: int, seen: int, index: torch.Tensor, slots: int):
        """Layer `layer_index`'s cache for the requests whose pages are `index`, all at position `seen` (with `slots`
        state slots). Its state tensors are kept in `gathered_states`: a state the step leaves as it was is not
        written back."""
        layout, pages = self.layouts[layer_index], self.state_layers[layer_index].kv_cache
        cache = new_layer_cache(self.config, layer_index)
        if seen == 0:
            return cache
        begin, end = window_span(self.config, layout.sliding, seen)
        cache.window.load([pages[j][index, :, :end - begin] for j in range(layout.window)], begin)
        if not layout.sliding:
            cache.set_state(*(pages[layout.window + j][index, :, :slots] for j in range(layout.state)))
            self.gathered_states[id(cache.state_keys)] = cache.state_keys
            cache.merged_blocks = merged_blocks(self.config, seen)
        cache.seen = seen
        return cache

    def scatter(self, rows: ScheduledRows, cache: KVMCache) -> None:
        """Write the advanced rows back into their pages, checking that each layer holds what its position says."""
        for group in cache.groups:
            members = torch.tensor(group.rows, device=rows.positions.device)
            slots = self.config.state_slots_after(group.seen)
            for layout, layer, pages, cached in zip(self.layouts, self.state_layers, rows.pages, group.layers):
                self.store_layer(layout, layer.kv_cache, pages[members], cached, slots)
        self.gathered_states = {}
        for carries, layout, layer, index in zip(cache.carries, self.layouts, self.state_layers, rows.pages):
            if layout.carries:
                layer.kv_cache[-1][index] = torch.cat([carries.values[name][:, 0] for name, _ in layout.carries],
                                                      dim=-1)

    def store_layer(self, layout: PageLayout, pages: list[torch.Tensor], index: torch.Tensor, cached,
                    slots: int) -> None:
        """One group's layer cache into the pages `index`; its state only when the step changed it (a fold, first-chunk
        tokens, or rows taken apart from their gathered group)."""
        config, seen = self.config, cached.seen
        begin, end = window_span(config, layout.sliding, seen)
        expected = {"window": (begin, end)}
        held = {"window": (cached.window.begin, cached.window.end)}
        if not layout.sliding:
            expected.update(slots=slots, merged=merged_blocks(config, seen))
            held.update(slots=cached.state_len, merged=cached.merged_blocks)
        if held != expected:
            raise RuntimeError(f"KVM on vLLM: after {seen} tokens a layer holds {held}, but its page layout expects "
                               f"{expected}; the page layout no longer follows the cache's rules")
        for j, tensor in enumerate(cached.window.live()):
            pages[j][index, :, :end - begin] = tensor
        if layout.sliding or self.gathered_states.get(id(cached.state_keys)) is cached.state_keys:
            return
        for j, tensor in enumerate(cached.state()):
            pages[layout.window + j][index, :, :tensor.shape[2]] = tensor

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Our head: lm_head, soft-capped when the config sets a cap (KVMForCausalLM.logits), in float32."""
        return KVMForCausalLM.logits(self, hidden_states).float()
