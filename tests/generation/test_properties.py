"""Property-based equivalence tests (hypothesis) over random small configs of both models.

Each case draws a config (KVM: chunk sizes, window chunks, sinks, budget modes and their parameters,
gates, token shifts, value residuals, alternating sliding-window layers; Maglev: windows and window
patterns, GQA, memory on/off, recurrent or prefiller prompts with shared or separate Q, optional
nanochat features), a batch, a prompt width, where the padding is, and how the rest is split into
forward calls. The properties:

- cached == uncached: a prompt then steps of any sizes give the logits of one uncached forward;
- padded/batched == unbatched: every row of a padded batch (left, right without a mask, or holes
  anywhere) gives the logits of its own real tokens read alone;
- a saved and reloaded cache continues bit for bit like the live one;
- KVM: every row's state length equals the config's closed form and stays within its budget, and
  `nbytes()` equals `cache_bytes`; Maglev: `nbytes()` equals `cache_bytes` and stays flat once the
  cache holds only sliding windows.

Profiles: the fast one (fixed examples, `derandomize`) runs in CI; the large one (300 cases per model,
every property on each case) runs with `pytest -m slow tests/generation/test_properties.py`. Setting
KVM_MAGLEV_PROPERTY_PROFILE=large runs the per-property tests with the large profile too, and
KVM_MAGLEV_PROPERTY_EXAMPLES=N changes the large profile's case count. A failure prints the drawn
case, config fields included.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.models.common.transformers_versions import CACHE_NAME
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.state_kvm import state_budget, state_slots_after
from kvm_maglev.models.maglev.cache_maglev import MaglevCache, windows_grow
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM
from kvm_maglev.package_only.saved_cache import load_cache, save_cache
from tests.models.maglev.test_maglev_model import randomize as randomize_maglev

VOCAB = 53
ATOL = 1e-4  # float32 logits: parallel chunks and token-by-token steps differ only by rounding
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile("kvm_maglev_fast", max_examples=15, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("kvm_maglev_large", max_examples=int(os.environ.get("KVM_MAGLEV_PROPERTY_EXAMPLES", 300)),
                          deadline=None, print_blob=True, suppress_health_check=_HEALTH)
LARGE = settings.get_profile("kvm_maglev_large")
FAST = LARGE if os.environ.get("KVM_MAGLEV_PROPERTY_PROFILE") == "large" else settings.get_profile("kvm_maglev_fast")



# ----- inputs shared by both models ------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One drawn example: config fields, token ids, padding and how the columns after the prompt are fed."""

    model: str
    config: dict
    seed: int
    batch: int
    prompt: int  # columns of the first forward
    steps: list[int]  # sizes of the later forwards
    padding: str  # "none", "left", "right" (no mask, no later steps) or "holes"
    mask: list[str]  # per row, "1" real / "0" padding for every column

    @property
    def width(self) -> int:
        return self.prompt + sum(self.steps)

    def ids(self) -> torch.Tensor:
        return torch.randint(1, VOCAB, (self.batch, self.width), generator=torch.Generator().manual_seed(self.seed))

    def mask_tensor(self) -> torch.Tensor:
        return torch.tensor([[int(c) for c in row] for row in self.mask], dtype=torch.long)

    def spans(self) -> list[tuple[int, int]]:
        """Column ranges of the forwards: the prompt, then each step."""
        spans, start = [(0, self.prompt)], self.prompt
        for step in self.steps:
            spans.append((start, start + step))
            start += step
        return spans


@st.composite
def inputs(draw, config: dict, padded: bool) -> Case:
    """Batch, prompt width, step sizes and (when `padded`) a padding layout; every row has a real prompt token."""
    batch = draw(st.integers(1, 3))
    prompt = draw(st.integers(1, 24))
    padding = draw(st.sampled_from(["left", "right", "holes"])) if padded else "none"
    steps = [] if padding == "right" else draw(st.lists(st.integers(1, 6), max_size=5))
    width = prompt + sum(steps)
    mask = []
    for _ in range(batch):
        if padding == "none":
            row = "1" * width
        elif padding in ("left", "right"):
            real = draw(st.integers(1, prompt))
            row = "0" * (prompt - real) + "1" * real if padding == "left" else "1" * real + "0" * (prompt - real)
            row += "1" * (width - prompt)
        else:
            bits = draw(st.lists(st.booleans(), min_size=width, max_size=width))
            bits[draw(st.integers(0, prompt - 1))] = True
            row = "".join("1" if b else "0" for b in bits)
        mask.append(row)
    seed = draw(st.integers(0, 2**16))
    return Case(model="", config=config, seed=seed, batch=batch, prompt=prompt, steps=steps, padding=padding,
                mask=mask)


def real_columns(case: Case, row: int, start: int, stop: int) -> list[int]:
    return [c for c in range(start, stop) if case.mask[row][c] == "1"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert actual.shape == expected.shape and error <= ATOL, f"{what}: max |difference| {error:.3g}"


def cache_keyword(model) -> str:
    return CACHE_NAME if isinstance(model, MaglevForCausalLM) else "cache"


def run_spans(model, case: Case, cache, ids: torch.Tensor, mask: torch.Tensor | None, after_each=None):
    """The case's forwards on `cache` (masks cover cached + new columns, as generate passes them); returns the
    logits of all columns. `after_each(columns read)` runs after every forward (checks on the cache)."""
    logits = []
    for start, stop in case.spans():
        step_mask = None if mask is None else mask[:, :stop]
        logits.append(model(ids[:, start:stop], attention_mask=step_mask, **{cache_keyword(model): cache}).logits)
        if after_each is not None:
            after_each(stop)
    return torch.cat(logits, dim=1)


# ----- Maglev --------------------------------------------------------------------------------------------
@st.composite
def maglev_configs(draw) -> dict:
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    hidden = heads * head_dim
    layers = draw(st.integers(1, 3))
    use_memory = draw(st.booleans())
    window = st.integers(2, 10)
    sliding_window = draw(window if use_memory else st.one_of(st.none(), window))
    prompt_mode = draw(st.sampled_from(["recurrent", "prefiller"])) if use_memory else "recurrent"
    has_prefiller = prompt_mode == "prefiller" or (use_memory and draw(st.booleans()))
    return dict(
        vocab_size=VOCAB, pad_vocab_size_to=draw(st.sampled_from([1, 64])), hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        max_position_embeddings=draw(st.sampled_from([8, 16, 64])),
        window_pattern=draw(st.text("SL", min_size=1, max_size=3)),
        logit_softcap=draw(st.sampled_from([None, 15.0])),
        use_value_embeddings=draw(st.booleans()), value_embedding_gate_channels=min(12, hidden),
        use_smear=draw(st.booleans()), smear_gate_channels=min(24, hidden),
        use_backout=draw(st.booleans()), backout_layer=draw(st.integers(0, layers - 1)),
        use_layer_lambdas=draw(st.booleans()), use_memory=use_memory, sliding_window=sliding_window,
        memory_gate_channels=draw(st.integers(1, hidden)), has_prefiller=has_prefiller,
        prefiller_window_pattern=draw(st.text("SL", min_size=1, max_size=3)),
        prefiller_shares_blocks=draw(st.booleans()), memory_prefill=prompt_mode,
    )


@st.composite
def maglev_cases(draw, padded: bool = False) -> Case:
    case = draw(inputs(draw(maglev_configs()), padded))
    case.model = "maglev"
    return case


def maglev_model(case: Case) -> MaglevForCausalLM:
    torch.manual_seed(case.seed)
    model = randomize_maglev(MaglevForCausalLM(MaglevConfig(**case.config)), case.seed).eval()
    return model


def maglev_reference(model: MaglevForCausalLM, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of one unpadded row read without splits: one uncached forward; with the prefiller, the prompt
    (its first `prompt` tokens, read by Q) then the rest in one recurrent forward."""
    if model.config.memory_prefill != "prefiller":
        return model(ids, use_cache=False).logits
    cache = MaglevCache(model.config)
    logits = [model(ids[:, :prompt], past_key_values=cache).logits]
    if ids.shape[1] > prompt:
        logits.append(model(ids[:, prompt:], past_key_values=cache).logits)
    return torch.cat(logits, dim=1)


def maglev_state(cache: MaglevCache) -> list[torch.Tensor]:
    tensors = [cache.positions, cache.previous_embedding]
    tensors += [] if cache.last_memory is None else [cache.last_memory]
    for store in cache.layers:
        tensors += list(store.tensors.values())
    return tensors


@torch.no_grad()
def check_maglev_cached_equals_uncached(case: Case) -> None:
    model = maglev_model(case)
    ids = case.ids()
    cached = run_spans(model, case, MaglevCache(model.config), ids, None)
    assert_close(cached, maglev_reference(model, ids, case.prompt), "cached vs uncached")


@torch.no_grad()
def check_maglev_padded_equals_unbatched(case: Case) -> None:
    model = maglev_model(case)
    ids, mask = case.ids(), case.mask_tensor()
    cache = MaglevCache(model.config)
    feed_mask = None if case.padding == "right" else mask
    batched = run_spans(model, case, cache, ids, feed_mask)
    for row in range(case.batch):
        columns = real_columns(case, row, 0, case.width)
        prompt = len(real_columns(case, row, 0, case.prompt))
        alone = maglev_reference(model, ids[row:row + 1, columns], prompt)
        assert_close(batched[row:row + 1, columns], alone, f"row {row} of the padded batch vs alone")
    if case.padding != "right":
        assert cache.positions.tolist() == [row.count("1") for row in case.mask]
    assert cache.nbytes() == cache_bytes(model.config, case.width, case.batch, dtype=torch.float32)


@torch.no_grad()
def check_maglev_saved_equals_live(case: Case) -> None:
    model = maglev_model(case)
    ids, mask = case.ids(), case.mask_tensor()
    live = MaglevCache(model.config)
    model(ids[:, :case.prompt], attention_mask=mask[:, :case.prompt], past_key_values=live)
    with tempfile.TemporaryDirectory() as folder:
        save_cache(live, folder)
        loaded = load_cache(folder, model, MaglevCache)
    assert loaded.nbytes() == live.nbytes() and loaded.get_seq_length() == live.get_seq_length()
    for a, b in zip(maglev_state(loaded), maglev_state(live), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for start, stop in case.spans()[1:]:
        step = ids[:, start:stop]
        a = model(step, attention_mask=mask[:, :stop], past_key_values=loaded).logits
        b = model(step, attention_mask=mask[:, :stop], past_key_values=live).logits
        assert torch.equal(a, b), f"columns [{start}, {stop}): saved cache differs from the live one"


@torch.no_grad()
def check_maglev_cache_size(case: Case) -> None:
    """nbytes() equals the closed form after every forward; with a sliding window it never changes, with
    nanochat's window pattern it never shrinks and stays within the windows."""
    model = maglev_model(case)
    config = model.config
    cache = MaglevCache(config)
    flat = not windows_grow(config)
    sizes = []

    def after_each(columns: int) -> None:
        sizes.append(cache.nbytes())
        assert sizes[-1] == cache_bytes(config, columns, case.batch, dtype=torch.float32), columns
        if flat:
            assert cache.layer_lengths() == [w for w in config.decoder_windows]

    run_spans(model, case, cache, case.ids(), None, after_each)
    if flat:
        assert len(set(sizes)) == 1, sizes
    assert sizes == sorted(sizes) and all(n <= w for n, w in zip(cache.layer_lengths(), config.decoder_windows))


MAGLEV_CHECKS = (check_maglev_cached_equals_uncached, check_maglev_padded_equals_unbatched,
                 check_maglev_saved_equals_live, check_maglev_cache_size)


@FAST
@given(case=maglev_cases())
def test_maglev_cached_equals_uncached(case):
    check_maglev_cached_equals_uncached(case)


@FAST
@given(case=maglev_cases(padded=True))
def test_maglev_padded_batch_equals_rows_alone(case):
    check_maglev_padded_equals_unbatched(case)


@FAST
@given(case=maglev_cases(padded=True))
def test_maglev_saved_cache_continues_like_live(case):
    check_maglev_saved_equals_live(case)


@FAST
@given(case=maglev_cases())
def test_maglev_cache_size_matches_config_and_stays_flat(case):
    check_maglev_cache_size(case)


@pytest.mark.slow
@LARGE
@given(case=maglev_cases(padded=True), unpadded=maglev_cases())
def test_maglev_all_properties_large(case, unpadded):
    check_maglev_cached_equals_uncached(unpadded)
    check_maglev_cache_size(unpadded)
    check_maglev_padded_equals_unbatched(case)
    check_maglev_saved_equals_live(case)


# ----- KVM -----------------------------------------------------------------------------------------------
@st.composite
def kvm_configs(draw) -> dict:
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    residual_modes = st.sampled_from(["linear", "rwkv", "rwkv_post_tokenshift"])
    kvm_mode, sliding_mode = draw(residual_modes), draw(residual_modes)
    value_head_dim = head_dim if "rwkv_post_tokenshift" in (kvm_mode, sliding_mode) else draw(st.sampled_from([4, 8]))
    sliding_every = draw(st.sampled_from([0, 0, 2, 3]))
    layers = draw(st.integers(2 if sliding_every else 1, 3))
    chunk = draw(st.integers(1, 5))
    budget_mode = draw(st.sampled_from(["fixed", "power_law", "kvm_saturation"]))
    fields = dict(
        vocab_size=VOCAB, hidden_size=heads * head_dim, num_hidden_layers=layers, num_attention_heads=heads,
        head_dim=head_dim, value_head_dim=value_head_dim, intermediate_size=2 * heads * head_dim,
        rotary_dim=draw(st.sampled_from(list(range(2, head_dim + 1, 2)))), chunk_size=chunk,
        window_chunks=draw(st.integers(1, 3)), sink_slots=draw(st.integers(0, chunk - 1)),
        state_budget_mode=budget_mode, state_budget_min=draw(st.integers(-1, 3 * chunk)),
        state_budget_round_to=draw(st.integers(1, 4)), state_max_chunks=draw(st.integers(1, 5)),
        merge_gate_keys=draw(st.booleans()), merge_gate_values=draw(st.booleans()),
        merge_gate_appends=draw(st.booleans()), merge_gate_initial_state=draw(st.booleans()),
        head_temperatures=draw(st.booleans()), kvm_token_shift=draw(st.booleans()),
        ffn_token_shift=draw(st.booleans()), value_residual=draw(st.booleans()), kvm_value_residual_mode=kvm_mode,
        sliding_window_every=sliding_every, sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        sliding_window_rotary_dim=draw(st.sampled_from([0, 2, head_dim])),
        sliding_window_token_shift=draw(st.booleans()), sliding_window_value_residual_mode=sliding_mode,
        sliding_window_share_value_residual=draw(st.booleans()), block_lambdas=draw(st.booleans()),
        logit_softcap=draw(st.sampled_from([0.0, 5.0])),
    )
    if budget_mode == "power_law":
        fields.update(state_budget_factor=draw(st.floats(0.5, 3.0)), state_budget_exponent=draw(st.floats(0.0, 1.0)))
    elif budget_mode == "kvm_saturation":
        fields.update(state_budget_saturation=draw(st.integers(1, 40)))
    one_chunk = fields["state_max_chunks"] == 1 or (budget_mode == "fixed" and fields["state_budget_min"] <= chunk)
    fields["state_value_norms"] = draw(st.booleans()) if one_chunk else True
    return fields


@st.composite
def kvm_cases(draw, padded: bool = False) -> Case:
    case = draw(inputs(draw(kvm_configs()), padded))
    case.model = "kvm"
    return case


def kvm_model(case: Case) -> KVMForCausalLM:
    """Tiny model whose every parameter matters (the default init zeroes some paths)."""
    torch.manual_seed(case.seed)
    model = KVMForCausalLM(KVMConfig(**case.config)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def check_kvm_state(cache: KVMCache, config: KVMConfig) -> None:
    """Every row's state length is the closed form for its own length, within the budget; bytes match too."""
    lengths = cache.row_lengths()
    for row, (seen, slots) in enumerate(zip(lengths, cache.row_state_lengths(), strict=True)):
        budget = max(min(seen, config.chunk_size), min(state_budget(config, seen), config.max_state_slots))
        for layer_idx, length in enumerate(slots):
            if config.is_sliding_window_layer(layer_idx):
                assert length == -1
                continue
            assert length == state_slots_after(config, seen), (row, layer_idx, seen, length)
            assert length <= budget, (row, layer_idx, seen, length, budget)
    expected = sum(cache_bytes(config, seen, 1, dtype=torch.float32) for seen in lengths)
    assert cache.nbytes() == expected, (cache.nbytes(), expected, lengths)


@torch.no_grad()
def check_kvm_cached_equals_uncached(case: Case) -> None:
    model = kvm_model(case)
    ids = case.ids()
    cache = KVMCache(model.config)
    cached = run_spans(model, case, cache, ids, None, lambda _: check_kvm_state(cache, model.config))
    assert_close(cached, model(ids, use_cache=False).logits, "cached vs uncached")


@torch.no_grad()
def check_kvm_padded_equals_unbatched(case: Case) -> None:
    model = kvm_model(case)
    ids, mask = case.ids(), case.mask_tensor()
    cache = KVMCache(model.config)
    feed_mask = None if case.padding == "right" else mask
    batched = run_spans(model, case, cache, ids, feed_mask)
    for row in range(case.batch):
        columns = real_columns(case, row, 0, case.width)
        alone = model(ids[row:row + 1, columns], use_cache=False).logits
        assert_close(batched[row:row + 1, columns], alone, f"row {row} of the padded batch vs alone")
    if case.padding != "right":
        assert cache.row_lengths() == [row.count("1") for row in case.mask]


@torch.no_grad()
def check_kvm_state_within_budget(case: Case) -> None:
    model = kvm_model(case)
    ids, mask = case.ids(), case.mask_tensor()
    cache = KVMCache(model.config)
    feed_mask = None if case.padding == "right" else mask
    run_spans(model, case, cache, ids, feed_mask, lambda _: check_kvm_state(cache, model.config))


@torch.no_grad()
def check_kvm_saved_equals_live(case: Case) -> None:
    model = kvm_model(case)
    ids, mask = case.ids(), case.mask_tensor()
    live = KVMCache(model.config)
    model(ids[:, :case.prompt], attention_mask=mask[:, :case.prompt], cache=live)
    with tempfile.TemporaryDirectory() as folder:
        save_cache(live, folder)
        loaded = load_cache(folder, model, KVMCache)
    assert loaded.nbytes() == live.nbytes() and loaded.get_seq_length() == live.get_seq_length()
    assert loaded.row_lengths() == live.row_lengths()
    assert loaded.row_state_lengths() == live.row_state_lengths()
    for start, stop in case.spans()[1:]:
        step = ids[:, start:stop]
        a = model(step, attention_mask=mask[:, :stop], cache=loaded).logits
        b = model(step, attention_mask=mask[:, :stop], cache=live).logits
        assert torch.equal(a, b), f"columns [{start}, {stop}): saved cache differs from the live one"


@FAST
@given(case=kvm_cases())
def test_kvm_cached_equals_uncached(case):
    check_kvm_cached_equals_uncached(case)


@FAST
@given(case=kvm_cases(padded=True))
def test_kvm_padded_batch_equals_rows_alone(case):
    check_kvm_padded_equals_unbatched(case)


@FAST
@given(case=kvm_cases(padded=True))
def test_kvm_saved_cache_continues_like_live(case):
    check_kvm_saved_equals_live(case)


@FAST
@given(case=kvm_cases(padded=True))
def test_kvm_state_within_budget_and_closed_form(case):
    check_kvm_state_within_budget(case)


@pytest.mark.slow
@LARGE
@given(case=kvm_cases(padded=True), unpadded=kvm_cases())
def test_kvm_all_properties_large(case, unpadded):
    check_kvm_cached_equals_uncached(unpadded)
    check_kvm_padded_equals_unbatched(case)
    check_kvm_state_within_budget(case)
    check_kvm_saved_equals_live(case)
