"""KVMCache: cached decoding equals the uncached forward for any prompt and step sizes,
the state stays within its budget, sizes match the closed form, batch operations work."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from transformers import LlamaConfig

from kvm_maglev.cache_sizes import cache_bytes, full_attention_cache_bytes
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.state_kvm import state_budget, state_slots_after
from kvm_maglev.vllm.page_caches import kvm_cache_over_pages, layer_carries
from tests.generation.testers import kvm_row_tensors

BASE = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8,
    chunk_size=4, window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0,
    state_budget_min=4, state_max_chunks=100,
)
VARIANTS = {
    "power_law": {},
    "counts_no_gates_no_temps_no_sink": dict(
        state_value_norms=False, merge_gate_keys=False, merge_gate_values=False, head_temperatures=False, sink_slots=0,
        state_budget_mode="fixed", state_budget_min=4,
    ),
    "saturation_swa_post_tokenshift": dict(
        num_hidden_layers=4, sliding_window_every=2, sliding_window=5, sliding_window_rotary_dim=16,
        merge_gate_appends=False, merge_gate_initial_state=True, kvm_value_residual_mode="rwkv_post_tokenshift",
        block_lambdas=True, logit_softcap=5.0, state_budget_mode="kvm_saturation", state_budget_saturation=16,
        state_budget_min=1,
    ),
    "fixed_linear_residual_no_shift": dict(
        num_hidden_layers=4, sliding_window_every=2, sliding_window_rotary_dim=0, kvm_value_residual_mode="linear",
        sliding_window_value_residual_mode="linear", kvm_token_shift=False, ffn_token_shift=False,
        state_budget_mode="fixed", state_budget_min=6, state_max_chunks=2, sliding_window_share_value_residual=True,
        window_chunks=3,
    ),
}
LENGTH = 45



def random_model(seed: int = 0, **overrides) -> KVMForCausalLM:
    """Tiny model whose every parameter matters (the default init zeroes some paths)."""
    torch.manual_seed(seed)
    model = KVMForCausalLM(KVMConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_equals_uncached_forward(variant):
    model = random_model(**VARIANTS[variant])
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    chunk = model.config.chunk_size
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        # prompt of 1 token, a partial chunk, an exact chunk boundary, exactly the front window, beyond it
        for prompt in (1, chunk - 1, chunk, model.config.window_size, model.config.window_size + 1):
            for steps in ((1,), (1, 2, 5, 3, 7)):  # one token per step, and multi-token steps
                cache = returned_cache(model(ids[:, :prompt]))
                logits, pos = [model(ids[:, :prompt], use_cache=False).logits], prompt
                for step in itertools.cycle(steps):
                    if pos >= LENGTH:
                        break
                    step = min(step, LENGTH - pos)
                    logits.append(model(ids[:, pos : pos + step], cache=cache).logits)
                    pos += step
                    assert cache.get_seq_length() == pos
                error = (torch.cat(logits, dim=1) - full).abs().max().item()
                assert error < 1e-4, (prompt, steps, error)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_page_layouts_carries_are_the_cache_layers(variant):
    """The carries the vLLM plugin lays out in a layer's page (`page_caches.layer_carries`) are the token-shift
    carries a cache layer holds after a forward: the same streams at the same widths."""
    model = random_model(**VARIANTS[variant])
    cache = KVMCache(model.config)
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)), cache=cache)
    carried = 0
    for layer, cache_layer in zip(model.model.layers, cache.layers):
        held = {name.removeprefix("carry."): tensor.shape[-1] for name, tensor in cache_layer.tensors.items()
                if name.startswith("carry.")}
        assert dict(layer_carries(layer)) == held
        carried += len(held)
    assert carried  # every variant shifts some stream


@torch.no_grad()
def test_rows_starting_on_used_pages_read_nothing_of_them():
    """A cache over an engine's pages (`page_caches.kvm_cache_over_pages`) empties the pages of rows at position 0,
    which another request used: rows started on pages full of NaN give the uncached forward's logits, prompt and
    next token, and a row further on keeps its pages as they were."""
    model = random_model()
    used = KVMCache(model.config)
    model(torch.randint(0, 97, (3, 30), generator=torch.Generator().manual_seed(4)), cache=used)
    pages = [{name: torch.full_like(tensor, float("nan")) for name, tensor in layer.tensors.items()}
             for layer in used.layers]
    cache = kvm_cache_over_pages(model.config, pages, [torch.tensor([2, 0, 1])] * len(pages), [0, 0, 5])
    for layer in pages:
        assert all(not bool(tensor[[0, 2]].any()) and bool(tensor[1].isnan().all()) for tensor in layer.values())
    cache.seen, cache.rows = [0, 0], 2  # the two fresh rows alone: pages 2 and 0
    for layer in cache.layers:
        layer.index = layer.index[:2]
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    full = model(ids, use_cache=False).logits
    torch.testing.assert_close(model(ids[:, :10], cache=cache).logits, full[:, :10], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids[:, 10:], cache=cache).logits, full[:, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_within_budget_and_sizes_match_closed_form(variant):
    model = random_model(**VARIANTS[variant])
    config = model.config
    ids = torch.randint(0, 97, (3, LENGTH), generator=torch.Generator().manual_seed(2))
    cache = KVMCache(config)
    with torch.no_grad():
        for pos in range(LENGTH):
            model(ids[:, pos : pos + 1], cache=cache)
            seen = pos + 1
            budget = max(min(seen, config.chunk_size), min(state_budget(config, seen), config.max_state_slots))
            for layer_idx, slots in enumerate(cache.state_lengths()):
                if config.is_sliding_window_layer(layer_idx):
                    assert slots == -1
                    continue
                assert slots == state_slots_after(config, seen)
                assert slots <= budget
                assert slots <= config.max_state_slots or slots <= config.chunk_size
            assert cache.nbytes() == cache_bytes(config, seen, batch_size=3, dtype=torch.float32)


def test_cache_bytes_by_dtype_and_full_attention_comparison():
    config = random_model().config
    long = 4096
    assert cache_bytes(config, 0) == 0
    assert cache_bytes(config, long, dtype=torch.float32) > cache_bytes(config, long, dtype=torch.bfloat16)
    # both 16-bit dtypes keep the state sums in float32 (float16 overflows, bfloat16 loses small additions)
    assert cache_bytes(config, long, dtype=torch.float16) == cache_bytes(config, long, dtype=torch.bfloat16)
    assert full_attention_cache_bytes(config, long) == 2 * long * 2 * (16 + 16) * 2
    assert cache_bytes(config, long) < full_attention_cache_bytes(config, long)
    fixed = KVMConfig(**{**BASE, "state_budget_mode": "fixed", "state_budget_min": 4, "state_max_chunks": 1})
    assert cache_bytes(fixed, 10_000) == cache_bytes(fixed, 20_000)  # constant once the window is full
    # sizes are known for our configs only, a loaded config included (they read its model type, not its class)
    for size in (cache_bytes, full_attention_cache_bytes):
        with pytest.raises(ValueError, match="KVM and Maglev configs, not model_type='llama'"):
            size(LlamaConfig(), 16)


def test_decode_step_writes_in_place_without_copying_the_window():
    """A decoding step writes its token into the window ring and its carries in place (no window is copied); the
    state's tensors change only at a chunk boundary, and are reallocated only when a growing state outgrows them
    (geometrically: rarely)."""
    model = random_model(chunk_size=8)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = returned_cache(model(ids[:, :17]))
        layer = cache.layers[0]
        fixed = {name: t.data_ptr() for name, t in layer.tensors.items() if name.startswith(("window", "carry"))}
        grown, reallocations = layer.tensors["state_keys"].data_ptr(), 0
        for pos in range(17, 40):
            before = layer.tensors["state_keys"][:, :, :layer.live_slots(pos)].clone()
            model(ids[:, pos : pos + 1], cache=cache)
            assert {name: layer.tensors[name].data_ptr() for name in fixed} == fixed
            reallocations += layer.tensors["state_keys"].data_ptr() != grown
            grown = layer.tensors["state_keys"].data_ptr()
            if pos % 8:  # the state only changes when a chunk starts
                assert torch.equal(layer.tensors["state_keys"][:, :, :before.shape[2]], before)
        assert reallocations <= 2


def test_batch_operations():
    model = random_model()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        def run(cache, rows):
            return model(ids[rows, 20:], cache=cache).logits

        reference = model(ids, use_cache=False).logits[:, 20:]
        cache = returned_cache(model(ids[:, :20]))
        cache.reorder_cache(torch.tensor([1, 0]))
        assert torch.allclose(run(cache, [1, 0]), reference[[1, 0]], atol=1e-5)
        cache = returned_cache(model(ids[:, :20]))
        cache.batch_repeat_interleave(2)
        assert torch.allclose(run(cache, [0, 0, 1, 1]), reference[[0, 0, 1, 1]], atol=1e-5)
        cache = returned_cache(model(ids[:, :20]))
        cache.batch_select_indices(torch.tensor([1]))
        assert torch.allclose(run(cache, [1]), reference[[1]], atol=1e-5)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.nbytes() == 0
        assert torch.allclose(model(ids, cache=cache).logits, model(ids, use_cache=False).logits, atol=1e-5)


def test_unsupported_cache_operations_raise_clear_errors():
    model = random_model()
    cache = returned_cache(model(torch.tensor([[1, 2, 3]])))
    assert cache.is_compileable is False and cache.is_croppable is False
    with pytest.raises(ValueError, match="recording is not active"):
        cache.crop(-1)
    with pytest.raises(TypeError, match="KVMCache"):
        from transformers import DynamicCache
        model(torch.tensor([[1, 2]]), past_key_values=DynamicCache())


def test_past_key_values_keyword_and_attention_mask_of_ones():
    model = random_model()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = returned_cache(model(ids[:, :7], attention_mask=torch.ones(2, 7, dtype=torch.long)))
        step = model(ids[:, 7:], past_key_values=cache).logits
        assert torch.allclose(step, model(ids, use_cache=False).logits[:, 7:], atol=1e-5)


@pytest.mark.parametrize("heads,chunk,speedups", [(1, 64, False), (2, 64, True), (4, 64, False), (2, 256, True)])
def test_fold_ahead_is_done_before_its_boundary(heads, chunk, speedups):
    """The fold's stages are paced to fit in 7/8 of a chunk, whether or not runtime_speedups is open: the
    boundary step only swaps the result in. Every boundary of a long decode finds its fold done."""
    model = random_model(num_attention_heads=heads, hidden_size=64, rotary_dim=8, chunk_size=chunk)
    ids = torch.randint(0, 97, (1, 5 * chunk), generator=torch.Generator().manual_seed(7))
    checked = 0
    with torch.no_grad(), model.runtime_speedups() if speedups else contextlib.nullcontext():
        cache = KVMCache(model.config)
        model(ids[:, :3], cache=cache)
        for pos in range(3, ids.shape[1]):
            model(ids[:, pos : pos + 1], cache=cache)
            if pos % chunk == chunk - 1 and pos >= 2 * chunk:  # the step before a boundary that folds a block
                for layer in cache.layers:
                    if not layer.is_sliding:
                        assert layer.pending is not None and layer.pending.done, pos
                        checked += 1
    assert checked > 0


@pytest.mark.parametrize("speedups", [False, True])
def test_a_decoding_step_advances_the_fold_by_one_stage_at_most(speedups):
    """Stepped directly or inside runtime_speedups, a decoding step advances the fold under way by at most
    one stage, so that its stages spread over the chunk."""
    model = random_model(num_attention_heads=4, hidden_size=64, rotary_dim=8, chunk_size=64)
    ids = torch.randint(0, 97, (1, 260), generator=torch.Generator().manual_seed(8))
    advanced = 0
    with torch.no_grad(), model.runtime_speedups() if speedups else contextlib.nullcontext():
        cache = KVMCache(model.config)
        model(ids[:, :130], cache=cache)
        fold, stage = None, 0
        for pos in range(130, 260):
            model(ids[:, pos : pos + 1], cache=cache)
            now = cache.layers[0].pending
            if now is fold and now is not None:
                assert now.next_stage - stage <= 1, pos
                advanced += now.next_stage - stage
            fold, stage = now, 0 if now is None else now.next_stage
    assert advanced > 0


@pytest.mark.parametrize("budget", [{}, dict(state_budget_mode="fixed", state_budget_min=6)])
@pytest.mark.parametrize("speedups", [False, True])
def test_folds_computed_ahead_are_bitwise_identical(budget, speedups):
    """A model stepped with its cache, by a loop of one's own (`speedups` off) or inside runtime_speedups
    as generate() steps it, folds the next block head by head during the chunk before its boundary; the
    boundary step swaps the result in. Logits and state equal the fold at the boundary's bit for bit, which
    the cache layers' `paced_folds` flag off gives (what the vLLM plugin runs)."""
    model = random_model(num_attention_heads=4, hidden_size=64, rotary_dim=8, **budget)
    ids = torch.randint(0, 97, (2, 50), generator=torch.Generator().manual_seed(6))

    def decode(ahead: bool):
        cache = KVMCache(model.config)
        for layer in cache.layers:
            layer.paced_folds = ahead
        logits = [model(ids[:, :3], cache=cache).logits]
        for pos in range(3, 50):
            logits.append(model(ids[:, pos : pos + 1], cache=cache).logits)
            layer = cache.layers[0]
            if ahead and pos % 4 == 3 and pos >= 11:  # the last step of a chunk: the next fold is under way
                fold = layer.pending
                assert fold is not None and 0 < fold.next_stage < len(fold.stages)
        return torch.cat(logits, dim=1), cache

    with torch.no_grad(), model.runtime_speedups() if speedups else contextlib.nullcontext():
        ahead, ahead_cache = decode(True)
        at_boundary, boundary_cache = decode(False)
    assert all(layer.pending is None for layer in boundary_cache.layers)
    assert torch.equal(ahead, at_boundary)
    for row in range(2):
        assert all(torch.equal(x, y) for x, y in zip(kvm_row_tensors(ahead_cache, row), kvm_row_tensors(boundary_cache, row)))
