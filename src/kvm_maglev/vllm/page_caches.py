"""The models' caches over a serving engine's pages: the plugin's adapter, which binds each cache layer to the pages
vLLM allocated, so that the models' own layer code reads and writes them in place (no copy into a cache and back).
The models know only that a layer's storage row of a forward's row i is `index[i]` (`RowStorage`); a Maglev cache
over pages also reads large rings in place in its one-token steps (`PagedMaglevCache`)."""

from __future__ import annotations

import torch

from kvm_maglev.models.common.row_storage import RowStorage
from kvm_maglev.models.kvm.cache_kvm import KVMCache
from kvm_maglev.models.kvm.configuration_kvm import KVMConfig
from kvm_maglev.models.maglev.cache_maglev import MaglevCache, TokenStep
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.vllm.in_place_reads import PagedTokenStep


def bind_pages(storage: RowStorage, tensors: dict[str, torch.Tensor], index: torch.Tensor) -> None:
    """Let `storage` read and write `tensors` (an engine's pages, [pages, ...] each), the forward's rows being pages
    `index`. When those are consecutive (requests admitted together often hold consecutive pages), reading all rows
    is a view of the pages, not a copy (`RowStorage.run`)."""
    storage.tensors, storage.index = tensors, index
    pages = index.tolist()
    consecutive = bool(pages) and pages == list(range(pages[0], pages[0] + len(pages)))
    storage.run = slice(pages[0], pages[0] + len(pages)) if consecutive else None


def step_page_indices(indices: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """Each layer's page of the step's first `count` requests, from vLLM's index tensors of the layers (`indices`), as
    new int64 tensors of this step (vLLM's are views of its buffers): one copy per distinct tensor, since the layers
    of one cache group share theirs."""
    made: dict[int, torch.Tensor] = {}
    for index in indices:
        if id(index) not in made:
            made[id(index)] = index[:count].to(torch.int64, copy=True)
    return [made[id(index)] for index in indices]


def zero_rows(storage: RowStorage, rows: torch.Tensor) -> None:
    """Empty the pages of the forward's rows `rows`: requests starting at position 0 on pages another request used
    (a model's own storage starts empty)."""
    for name in storage.tensors:
        storage.write(name, rows, torch.zeros((), dtype=storage.tensors[name].dtype, device=rows.device))


def layer_carries(layer) -> list[tuple[str, int]]:
    """The token-shifted streams a KVM decoder layer carries between forwards (a cache layer's `carry.<name>`), with
    their widths, in the order a page's carry vector holds them: the attention's q, k and v side by side (shifted in
    one call), its value-gate input, the feed-forward's. Widths are the layer's own: under tensor parallelism its
    rank's share of the heads."""
    attention, streams = layer.self_attn, []
    if attention.token_shift_on:
        streams += [("q", attention.num_heads * attention.head_dim), ("k", attention.kv_heads * attention.head_dim),
                    ("v", attention.kv_heads * attention.value_head_dim)]
    if attention.value_residual_mode == "rwkv_post_tokenshift":
        streams.append(("x", attention.config.hidden_size))
    if layer.mlp.token_shift_on:
        streams.append(("ffn", layer.mlp.shift.shape[-1]))
    return streams


def kvm_cache_over_pages(config: KVMConfig, pages: list[dict[str, torch.Tensor]], index: list[torch.Tensor],
                         seen: list[int]) -> KVMCache:
    """A KVMCache whose layers read and write the pages in place: `pages[i]` are layer i's page tensors (named as
    the layers name them, [pages, ...]), `index[i]` the page of each row in them, `seen` each row's position. Rows
    at position 0 start fresh whatever their pages hold."""
    cache = KVMCache(config)
    fresh = [row for row, position in enumerate(seen) if not position]
    fresh_rows = torch.tensor(fresh, device=index[0].device) if fresh else None
    for layer, tensors, pages_of_rows in zip(cache.layers, pages, index):
        bind_pages(layer, tensors, pages_of_rows)
        if fresh_rows is not None:
            zero_rows(layer, fresh_rows)
    cache.seen, cache.rows, cache.paged = list(seen), len(seen), True
    return cache


class PagedMaglevCache(MaglevCache):
    """A MaglevCache whose rings are an engine's pages: its steps of one token per row (decoding, and each step of
    a recurrent prompt) are `PagedTokenStep`s, which read a request's ring in place when it is large."""

    def ring_steps(self, step: TokenStep) -> TokenStep:
        return super().ring_steps(PagedTokenStep(step))


def maglev_cache_over_pages(config: MaglevConfig, pages: list[dict[str, torch.Tensor]], index: list[torch.Tensor],
                            positions: list[int], memory: torch.Tensor, embedding: torch.Tensor,
                            memory_init: torch.Tensor | None) -> PagedMaglevCache:
    """A MaglevCache whose layers read and write the pages in place: `pages[i]` are layer i's ring tensors ("keys",
    "values": [pages, Hkv, slots, D]), `index[i]` the page of each row in them; `positions` each row's position,
    `memory` and `embedding` [rows, H] each row's carries. Rows at position 0 start fresh whatever their pages hold:
    empty rings, no smear, memory `memory_init` (None: the memory is off)."""
    cache = PagedMaglevCache(config)
    device = embedding.device
    fresh = torch.tensor([position == 0 for position in positions], device=device)
    for layer, tensors, rows in zip(cache.layers, pages, index):
        bind_pages(layer, tensors, rows)
        layer.batch, layer.grows = len(positions), False
        layer.capacity = tensors["keys"].shape[2]
        if bool(fresh.any()):
            zero_rows(layer, fresh.nonzero().squeeze(1))
    cache.positions = torch.tensor(positions, dtype=torch.long, device=device)
    cache.previous_embedding = torch.where(fresh[:, None], 0, embedding)[:, None]
    if memory_init is not None:
        cache.last_memory = torch.where(fresh[:, None], memory_init.to(memory.dtype), memory)[:, None]
    # 0 when every row starts fresh: the model's first forward, which the prefiller reads in "prefiller" mode (as
    # generate()'s first); else a count above 0, so that the forward continues the rows
    cache.columns = max(positions) + 1 if any(positions) else 0
    return cache
