"""One small "tester" per model for the shared generation tests: a tiny config and its variants, the model
factory, the cache class, and how to read a cache's state so two caches can be compared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvm_maglev import KVMConfig, KVMForCausalLM  # the package's classes: the row-block loss is theirs
from kvm_maglev.models.kvm import KVMCache
from kvm_maglev.models.kvm.cache_kvm import READ, STATE, WINDOW
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from tests.models.maglev.test_maglev_model import VOCAB as MAGLEV_VOCAB
from tests.models.maglev.test_maglev_model import tiny_model as tiny_maglev

PAD = 0


@dataclasses.dataclass(frozen=True)
class GenerationTester:
    """What the shared tests need to know about one model."""

    name: str
    vocab_size: int
    cache_class: type
    variants: dict[str, dict]  # config overrides, each a different path through the model
    block: int  # the unit the cache works in (KVM chunk, Maglev window): step sizes straddle it
    small: dict  # overrides of a smaller assistant model
    other_config: tuple[str, int]  # a field whose change makes a saved cache unusable, and its new value
    saved_files: list[str]
    build: Callable[..., torch.nn.Module]  # (seed=0, **overrides) -> eval model, every parameter random
    state: Callable[[object], list[torch.Tensor]]  # everything the cache holds
    row_state: Callable[[object, int], list[torch.Tensor]] | None  # what it holds for one row, where it can say
    row_lengths: Callable[[object], list[int]]  # real tokens read per row
    atol: float  # state built from steps of other sizes differs by float rounding
    window: Callable[[int], dict]  # config overrides giving an attention window of that many tokens

    def model(self, variant: str, seed: int = 0, **overrides) -> torch.nn.Module:
        return self.build(seed, **{**self.variants[variant], **overrides})

    def random_ids(self, batch: int, length: int, seed: int = 0) -> torch.Tensor:
        """Ids without the pad id (generate would mask it)."""
        return torch.randint(1, self.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))

    def prompts(self, lengths=(3, 9, 14, 6), seed: int = 7) -> list[torch.Tensor]:
        """Rows whose lengths put their block boundaries at different columns of a padded batch."""
        return [self.random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]

    def assert_same_state(self, a, b, atol: float | None = None) -> None:
        atol = self.atol if atol is None else atol
        assert a.get_seq_length() == b.get_seq_length() and self.row_lengths(a) == self.row_lengths(b)
        for x, y in zip(self.state(a), self.state(b), strict=True):
            assert x.shape == y.shape, (x.shape, y.shape)
            assert torch.allclose(x.to(y.dtype), y, atol=atol), (x - y).abs().max()


def left_padded(rows: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths, left-padded into one batch, and their mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


# ----- KVM ----------------------------------------------------------------------------------------------------
KVM_BASE = dict(
    vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=4,
    window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0, state_budget_min=4, state_max_chunks=100,
)
KVM_VARIANTS = {
    # state grows with the context (appends of the most novel tokens and merges)
    "power_law": {},
    # sliding-window layers in between, post-token-shift value gate, gated first chunk
    "saturation_swa": dict(
        num_hidden_layers=4, sliding_window_every=2, sliding_window=5, sliding_window_rotary_dim=16,
        kvm_value_residual_mode="rwkv_post_tokenshift", merge_gate_initial_state=True, state_budget_mode="kvm_saturation",
        state_budget_saturation=16, state_budget_min=1,
    ),
    # a one-chunk state merged into by every block, counts instead of value norms
    "fixed_counts": dict(state_value_norms=False, state_budget_mode="fixed", state_budget_min=4, state_max_chunks=1),
}
_KVM_MODELS: dict = {}


def tiny_kvm(seed: int = 0, **overrides) -> KVMForCausalLM:
    """Tiny model whose every parameter matters (the default init zeroes some paths); built once per config."""
    key = (seed, tuple(sorted(overrides.items())))
    if key not in _KVM_MODELS:
        torch.manual_seed(seed)
        model = KVMForCausalLM(KVMConfig(**{**KVM_BASE, **overrides})).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.3 * torch.randn_like(param))
        _KVM_MODELS[key] = model
    return _KVM_MODELS[key]


def kvm_row_tensors(cache: KVMCache, row: int) -> list[torch.Tensor]:
    """What the cache holds for one row, live entries only, the window in position order: per layer its window,
    state and carries (for comparing caches row by row)."""
    seen, out = cache.seen[row], []
    index = torch.tensor([row])
    for layer in cache.layers:
        slots = torch.arange(seen - layer.live_window(seen), seen) % layer.ring_size
        for name in sorted(layer.tensors):
            tensor = layer.read(name, index)
            if name in WINDOW:
                out.append(tensor[:, :, slots])
            elif name in STATE or name in READ:
                out.append(tensor[:, :, :layer.live_slots(seen)])
            elif seen:
                out.append(tensor)
    return out


def kvm_row_state(cache: KVMCache, row: int) -> list[torch.Tensor]:
    """Everything the cache holds for one row: per layer its live window (in position order), state and carries."""
    return kvm_row_tensors(cache, row) + [torch.tensor(cache.row_lengths()[row])]


KVM = GenerationTester(
    name="kvm", vocab_size=KVM_BASE["vocab_size"], cache_class=KVMCache, variants=KVM_VARIANTS,
    block=KVM_BASE["chunk_size"], small=dict(num_hidden_layers=2, hidden_size=16, rotary_dim=4, sliding_window_rotary_dim=8),
    other_config=("chunk_size", 8), saved_files=["kvm_cache.json", "kvm_cache.safetensors"], build=tiny_kvm,
    state=lambda cache: [t for row in range(cache.rows) for t in kvm_row_state(cache, row)],
    row_state=kvm_row_state, row_lengths=lambda cache: cache.row_lengths(),
    # oneDNN's linears block by row count, so states built from different chunkings differ by rounding
    atol=5e-5,
    # two chunks of half the window, or one chunk of all of it
    window=lambda w: dict(chunk_size=w // 2, window_chunks=2) if w % 2 == 0 else dict(chunk_size=w, window_chunks=1),
)


# ----- Maglev -------------------------------------------------------------------------------------------------
def maglev_state(cache: MaglevCache) -> list[torch.Tensor]:
    tensors = [cache.positions, cache.previous_embedding]
    tensors += [] if cache.last_memory is None else [cache.last_memory]
    for store in cache.layers:
        tensors += list(store.tensors.values())
    return tensors


MAGLEV = GenerationTester(
    name="maglev", vocab_size=MAGLEV_VOCAB, cache_class=MaglevCache,
    # memory on (recurrent), memory off with a sliding window (parallel ring chunks), nanochat windows
    # (full-window layers that keep every column), prompts read by the prefiller
    variants={
        "recurrent": {},
        "memory_off_ring": dict(use_memory=False),
        "nanochat_windows": dict(use_memory=False, sliding_window=None),
        "prefiller": dict(prefiller_shares_blocks=False, memory_prefill="prefiller"),
    },
    block=8, small=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
    other_config=("sliding_window", 12), saved_files=["maglev_cache.json", "maglev_cache.safetensors"],
    build=tiny_maglev, state=maglev_state, row_state=None, row_lengths=lambda cache: cache.positions.tolist(),
    atol=1e-5, window=lambda w: dict(sliding_window=w),
)

TESTERS = {tester.name: tester for tester in (KVM, MAGLEV)}


def cases(kvm: list[str] | None = None, maglev: list[str] | None = None) -> list:
    """(tester, variant) parameters: the named variants of each model, all of them when not named."""
    chosen = {"kvm": kvm, "maglev": maglev}
    return [pytest.param(tester, variant, id=f"{name}-{variant}")
            for name, tester in TESTERS.items() for variant in (chosen[name] or tester.variants)]
