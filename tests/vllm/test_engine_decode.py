"""KVM's decoding engine step (kvm_maglev.vllm.decode_kvm) against the model's own decoding step over the same
pages (`KVMModel.decoding_step`, `DecodeStep.token_shift` and `.attend` on a `kvm_cache_over_pages` cache): the same
outputs and the same pages afterwards (but a first-chunk token's state slot, which the engine enters at the window's
end from the ring: against the model's own entries too), eager and compiled, for rows at scattered pages and positions - in their
first chunk, past it, folding a block at this token - with vLLM's padding after the scheduled tokens; an
attention's q, k and v streams shifted in one call over their carries' columns, as the operator shifts them. The
warm-up's scratch pages against vLLM's binding of pages, and `packed` against a copy. The attention read in place -
by the CPU kernel, and request by request - against the gathering reference, alone and inside the engine step, KVM's
and Maglev's."""

import pytest
import torch

from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG
from kvm_maglev.models.kvm.cache_kvm import READ, STATE, KVMCache
from kvm_maglev.models.kvm.decode_attention_kvm import state_window_attention_torch
from kvm_maglev.vllm import decode_kvm, in_place_reads, paged_attention_cpu
from kvm_maglev.vllm.decode_kvm import (
    EngineDecode,
    compiled,
    decode_attention,
    decode_shift,
    enter_first_chunks,
    first_chunks_due,
    fold_due,
    packed,
    reach,
    scratch_pages,
    state_slot_table,
    state_window_attention_as_sums,
)
from kvm_maglev.vllm.in_place_reads import state_window_attention_by_page, state_window_attention_kernel
from kvm_maglev.vllm.kvm import carry_columns, name_pages, page_layout
from kvm_maglev.vllm.page_caches import kvm_cache_over_pages, layer_carries
from tests.models.kvm.test_decode_attention import decode_inputs
from tests.models.kvm.test_kvm_cache import VARIANTS, random_model

MAX_LEN = 64
PAGES = 12
PAGE_OF_ROW = [7, 2, 9, 3, 0, 11]
SEEN = [1, 3, 6, 12, 21, 30]  # chunks of 4, a window of 2 or 3 chunks: 12 folds a block in the 2-chunk variants
PADDING = 2


class PageLayout:
    """One layer's page shapes and dtypes, as vLLM's `MambaBase.bind_kv_cache` reads them from a state layer."""

    def __init__(self, layer: list[tuple]):
        self.shapes, self.dtypes = [shape for _, shape, _ in layer], [dtype for _, _, dtype in layer]

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes


def random_pages(model, generator: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's page tensors (`page_layout`), random (garbage a request's pages may hold is read alike), as
    vLLM binds them: views of one buffer per layer."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    pages = []
    for layer in page_layout(model.config, model.model, MAX_LEN, torch.float32):
        layout = PageLayout(layer)
        size = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in zip(layout.shapes, layout.dtypes))
        MambaBase.bind_kv_cache(layout, torch.zeros(PAGES, 1, 1, size, dtype=torch.int8))
        for tensor in layout.kv_cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        pages.append(layout.kv_cache)
    return pages


def layer_inputs(model, generator: torch.Generator) -> list[dict]:
    """Per layer: each token-shifted stream's input and mix, and the attention's q, k, v and merge gates, for the
    step's tokens and vLLM's padding after them."""
    tokens = len(SEEN) + PADDING
    inputs = []
    for layer in model.model.layers:
        attention = layer.self_attn
        streams = {name: (torch.randn(1, tokens, width, generator=generator), torch.rand(width, generator=generator))
                   for name, width in layer_carries(layer)}
        q = torch.randn(tokens, attention.num_heads, attention.head_dim, generator=generator)
        k = torch.randn(tokens, attention.kv_heads, attention.head_dim, generator=generator)
        v = torch.randn(tokens, attention.kv_heads, attention.value_head_dim, generator=generator)
        gate = 1 + torch.rand(tokens, attention.kv_heads, 1, generator=generator) if getattr(attention, "gated", False) \
            else None
        inputs.append({"streams": streams, "attention": (q, k, v, gate)})
    return inputs


def reference_step(model, pages, inputs) -> list:
    """The model's decoding step over the pages: its folds, then each layer's token shifts and attention."""
    count = len(SEEN)
    index = torch.tensor(PAGE_OF_ROW)
    named = name_pages(page_layout(model.config, model.model, MAX_LEN, torch.float32), model.model, pages)
    cache = kvm_cache_over_pages(model.config, named, [index] * len(pages), SEEN)
    step = model.model.decoding_step(cache, SEEN, index.device)
    outputs = []
    for layer, cache_layer, layer_in in zip(model.model.layers, cache.layers, inputs):
        for name, (x, mix) in layer_in["streams"].items():
            outputs.append(step.token_shift(x[:, :count], mix, cache_layer, name, "first"))
        q, k, v, gate = (None if t is None else t[:count] for t in layer_in["attention"])
        outputs.append(step.attend(layer.self_attn, cache_layer, q, k, v, gate))
    return outputs


def engine_step(model, pages, inputs, compiled: bool) -> list:
    """decode_kvm's step over the pages, as the operators run it; outputs cut to the scheduled tokens after
    checking that the padding's are zeros."""
    count, config = len(SEEN), model.config
    page_index = torch.tensor(PAGE_OF_ROW)
    positions = torch.tensor(SEEN + [0] * PADDING)
    named = name_pages(page_layout(config, model.model, MAX_LEN, torch.float32), model.model, pages)
    table = state_slot_table(config, MAX_LEN)
    decode = EngineDecode(count, list(SEEN), positions, [page_index] * len(pages), reach(config, table.tolist(), SEEN))
    assert min(SEEN) < config.chunk_size  # a row in its first chunk, whose state slot the engine writes later
    enter_first_chunks(model.model, named, decode.pages, decode.seen, [1] * count)  # as `build_rows` runs it
    fold_due(model.model, named, decode)
    outputs, shifted = [], {}
    for layer, layer_pages, layer_in in zip(model.model.layers, named, inputs):
        streams = layer_in["streams"]
        joint = [name for name in ("q", "k", "v") if name in streams]  # one call, as the operator shifts them
        for names in [[name] for name in streams if name not in joint] + ([joint] if joint else []):
            x = torch.cat([streams[name][0] for name in names], dim=-1)
            mix = torch.cat([streams[name][1].reshape(-1) for name in names])
            out = torch.full_like(x, float("nan"))
            decode_shift(x, mix, carry_columns(layer_pages, layer, names), page_index, count, out, compiled)
            assert not out[:, count:].any()
            widths = [streams[name][0].shape[-1] for name in names]
            shifted.update(zip(names, out[:, :count].split(widths, dim=-1)))
        outputs += [shifted.pop(name) for name in streams]
        q, k, v, gate = layer_in["attention"]
        out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"))
        decode_attention(layer.self_attn, q, k, v, gate, decode, page_index, out, layer_pages,
                         None if layer.sliding else table, compiled)
        assert not out[count:].any()
        outputs.append(out[:count])
    return outputs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_decode_equals_model_decoding_step(variant, compiled):
    if compiled and variant in ("counts_no_gates_no_temps_no_sink", "fixed_linear_residual_no_shift"):
        pytest.skip("compiled on the two variants with sliding-window layers or the gated power-law state only "
                    "(each variant is a compilation of its own: minutes on 2 shared cores)")
    model = random_model(**VARIANTS[variant])
    generator = torch.Generator().manual_seed(3)
    pages = random_pages(model, generator)
    inputs = layer_inputs(model, generator)
    engine_pages = random_pages(model, torch.Generator().manual_seed(3))  # the same values, their own buffer
    before = random_pages(model, torch.Generator().manual_seed(3))
    for state in (pages, engine_pages, before):
        entered_at_the_windows_end(model, state)
    # room for this variant's graphs however many the process compiled before (serving tests compile the same
    # functions for their folders), as the engine's warm-up gives a process serving several models
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=decode_kvm.WARM_UP_GRAPHS):
        expected = reference_step(model, pages, inputs)
        got = engine_step(model, engine_pages, inputs, compiled)
    # the same arithmetic but where the compiled graphs or the CPU kernel sum in another order
    exact = not compiled and not paged_attention_cpu.available()
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    assert len(got) == len(expected)
    for ours, reference in zip(got, expected):
        torch.testing.assert_close(ours, reference, **tolerance)
    layout = page_layout(model.config, model.model, MAX_LEN, torch.float32)
    for layer, layer_layout, ours, reference, old in zip(model.model.layers, layout, engine_pages, pages, before):
        expected = engine_convention(model.config, layer, dict(zip([name for name, _, _ in layer_layout], reference)),
                                     dict(zip([name for name, _, _ in layer_layout], old)))
        for (name, _, _), page in zip(layer_layout, ours):
            torch.testing.assert_close(page, expected[name], **tolerance)


def entered_at_the_windows_end(model, pages) -> None:
    """Random pages made as serving leaves a request at the window's end (a row of SEEN at `window_size`): its
    first chunk in its state as its ring holds it (`enter_first_chunks`; the model's own entries of those tokens
    are `test_first_chunks_entered_from_the_ring_equal_the_models_entries`)."""
    named = name_pages(page_layout(model.config, model.model, MAX_LEN, torch.float32), model.model, pages)
    assert first_chunks_due(model.config, SEEN, [1] * len(SEEN)) or model.config.window_size not in SEEN
    enter_first_chunks(model.model, named, [torch.tensor(PAGE_OF_ROW)] * len(pages), SEEN, [1] * len(SEEN))


def engine_convention(config, layer, reference: dict, before: dict) -> dict:
    """A layer's pages after the model's step (`reference`), as the engine leaves them: the state slots of a token
    in its first chunk as they were `before` the step (entered at the window's end)."""
    if layer.sliding:
        return reference
    expected = {name: tensor.clone() for name, tensor in reference.items()}
    for row, seen in enumerate(SEEN):
        if seen < config.chunk_size:
            for name in STATE + READ:
                expected[name][PAGE_OF_ROW[row], :, seen] = before[name][PAGE_OF_ROW[row], :, seen]
    return expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_first_chunks_entered_from_the_ring_equal_the_models_entries(variant):
    """The model enters each first-chunk token into its state as it reads it; the engine enters them all from the
    ring when a request's tokens reach the window's end (`enter_first_chunks`): the same slots, on pages at rows of
    the model's own cache after a prompt of `window_size` tokens (the ring whole, its first chunk not yet
    overwritten); due are the requests whose tokens of a step include position `window_size`."""
    model = random_model(**VARIANTS[variant])
    config = model.config
    ids = torch.randint(1, config.vocab_size, (2, config.window_size), generator=torch.Generator().manual_seed(5))
    cache = KVMCache(config)
    with torch.no_grad():
        model(input_ids=ids, **{GENERATE_CACHE_KWARG: cache}, use_cache=True)
    named = [{name: tensor.clone() for name, tensor in layer.tensors.items()} for layer in cache.layers]
    kvm_layers = [index for index, layer in enumerate(model.model.layers) if not layer.sliding]
    assert kvm_layers
    for index in kvm_layers:
        for name in STATE + READ:
            named[index][name][:, :, :config.chunk_size] = float("nan")
    rows = torch.arange(2)
    enter_first_chunks(model.model, named, [rows] * len(named), [config.window_size] * 2, [1, 1])
    for index in kvm_layers:
        for name in STATE + READ:
            ours = named[index][name][:, :, :config.chunk_size]
            torch.testing.assert_close(ours, cache.layers[index].tensors[name][:, :, :config.chunk_size],
                                       rtol=0, atol=0)
    assert first_chunks_due(config, [0, config.window_size - 2, config.window_size + 1], [3, 3, 3]) == [1]


def test_scratch_pages_are_laid_out_as_vllm_binds_pages():
    """The warm-up's scratch pages have the shapes, dtypes and strides of pages vLLM binds (`MambaBase.bind_kv_cache`
    over one byte row a page, padded to the largest layer's), and are not inference tensors, even when made in
    inference mode: the compiled graphs guard on all of these."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    model = random_model(**VARIANTS["saturation_swa_post_tokenshift"])  # sliding and KVM layers: pages of two sizes
    layout = page_layout(model.config, model.model, MAX_LEN, torch.float32)
    largest = max(sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in layer) for layer in layout)
    with torch.inference_mode():
        scratch = scratch_pages(layout, PAGES, torch.device("cpu"))
    assert len({len(layer) for layer in layout}) > 1
    for layer, tensors in zip(layout, scratch):
        bound = PageLayout(layer)
        MambaBase.bind_kv_cache(bound, torch.zeros(PAGES, 1, 1, largest, dtype=torch.int8))
        assert len(tensors) == len(bound.kv_cache)
        for ours, theirs in zip(tensors, bound.kv_cache):
            assert (ours.shape, ours.dtype, ours.stride()) == (theirs.shape, theirs.dtype, theirs.stride())
            assert not ours.is_inference()


def test_packed_gives_a_new_tensors_strides():
    tensor = torch.randn(5, 3, 1)
    assert packed(tensor) is tensor and packed(None) is None
    odd = tensor.as_strided((5, 3, 1), (3, 1, 7))  # contiguous to torch (a size-1 dimension's stride is free)
    assert odd.is_contiguous() and odd.stride() != tensor.stride()
    assert packed(odd).stride() == tensor.stride()
    torch.testing.assert_close(packed(odd), odd, rtol=0, atol=0)
    sliced = torch.randn(5, 6)[:, :3]
    assert packed(sliced).stride() == (3, 1)
    torch.testing.assert_close(packed(sliced), sliced, rtol=0, atol=0)


SUMS_COMPILED = compiled(state_window_attention_as_sums)


def sums_compiled(**inputs) -> torch.Tensor:
    """The sums form compiled, room made for a graph for each of the test's input kinds (temperatures, head groups,
    an empty state)."""
    with torch._dynamo.config.patch(recompile_limit=32):
        return SUMS_COMPILED(**inputs)


READING_IN_PLACE = {"by page": state_window_attention_by_page, "as sums": state_window_attention_as_sums,
                    "as sums, compiled": sums_compiled, "kernel": state_window_attention_kernel}


@pytest.mark.parametrize(("form", "dtype"), [(form, dtype) for form in sorted(READING_IN_PLACE)
                                             for dtype in (torch.float32, torch.bfloat16)
                                             if dtype == torch.float32 or "compiled" not in form])
@pytest.mark.parametrize("temperatures", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_attention_read_in_place_equals_the_gathering_reference(groups, temperatures, dtype, form):
    """Every form that reads the pages where they lie (a request at a time, up to its last visible ring slot and live
    state slot; sums of products, as compiled graphs run it; the CPU kernel) equals the reference, which gathers
    them."""
    if form == "kernel" and not paged_attention_cpu.available():
        pytest.skip("the CPU kernel did not build here")
    attention = READING_IN_PLACE[form]
    inputs = decode_inputs(groups, dtype, temperatures, seed=groups)
    out = attention(**inputs)
    assert out.dtype == dtype and out.shape == (4, 2 * groups, 8)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, state_window_attention_torch(**inputs), **tolerance)
    no_state = dict(inputs, state_keys=inputs["state_keys"][:, :, :0], state_values=inputs["state_values"][:, :, :0],
                    state_slots=inputs["state_slots"] * 0)  # a sliding-window layer reads no state
    torch.testing.assert_close(attention(**no_state), state_window_attention_torch(**no_state), **tolerance)


def read_pages(form: str, monkeypatch) -> None:
    """Make the decoding attentions over pages read them as `form` says: "kernel" (the CPU kernel, the default
    where it builds), "request by request" (torch, in place) or "gathered" (the reference)."""
    if form == "kernel" and not paged_attention_cpu.available():
        pytest.skip("the CPU kernel did not build here")
    monkeypatch.setenv("KVM_MAGLEV_CPU_KERNEL", "1" if form == "kernel" else "0")
    monkeypatch.setattr(in_place_reads, "IN_PLACE_MIN_BYTES", 0 if form == "request by request" else 1 << 40)


@pytest.mark.parametrize("form", ["kernel", "request by request"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_step_reading_pages_in_place_equals_gathering_them(variant, form, monkeypatch):
    """The whole eager decoding step with every attention reading its requests' pages in place (by the kernel, or
    request by request) equals the step that gathers them, outputs and pages."""
    model = random_model(**VARIANTS[variant])
    generator = torch.Generator().manual_seed(3)
    inputs = layer_inputs(model, generator)
    results = []
    for arm in (form, "gathered"):
        read_pages(arm, monkeypatch)
        pages = random_pages(model, torch.Generator().manual_seed(4))
        with torch.no_grad():
            results.append((engine_step(model, pages, inputs, compiled=False), pages))
    (in_place, in_place_pages), (gathered, gathered_pages) = results
    for ours, reference in zip(in_place + [t for layer in in_place_pages for t in layer],
                               gathered + [t for layer in gathered_pages for t in layer]):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_engine_attention_benchmark_times_every_way(tmp_path):
    from kvm_maglev.benchmarks.engine_attention import main

    payload = main(["--repeats", "1", "--out", str(tmp_path / "attention.json")])
    assert (tmp_path / "attention.json").exists() and len(payload["cases"]) >= 4
    for case in payload["cases"]:
        assert case["gathered_ms"] > 0 and case["in_place_ms"] > 0 and case["as_sums_compiled_ms"] > 0
        assert case["kernel_ms"] > 0 if paged_attention_cpu.available() else case["kernel_ms"] is None
        assert case["chosen_without_kernel"] == ("in place" if case["bytes_read_per_request"]
                                                 >= payload["in_place_min_bytes"] else "gathered")


def small_maglev(kv_heads: int):
    """A random recurrent Maglev decoder P (windows of 8 keys) with `kv_heads` key/value heads, in eval mode."""
    from kvm_maglev import MaglevConfig, MaglevForCausalLM
    from tests.models.maglev.test_maglev_model import randomize

    config = MaglevConfig(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=kv_heads, window_pattern="SL", sliding_window=8,
                          prefiller_window_pattern="SL", memory_gate_channels=12, has_prefiller=False)
    return randomize(MaglevForCausalLM(config), 0).eval().model


def maglev_over_random_pages(model, positions: list[int]):
    """Random ring pages of `model`'s layers (8 pages) and a cache over them whose rows, at `positions`, are on
    scattered pages with random carries: the same for the same arguments."""
    from kvm_maglev.vllm.maglev import ring_slots
    from kvm_maglev.vllm.page_caches import maglev_cache_over_pages

    config, generator = model.config, torch.Generator().manual_seed(2)
    rings = [{name: torch.randn(8, config.num_key_value_heads, slots, config.head_dim, generator=generator)
              for name in ("keys", "values")} for slots in ring_slots(config, 64)]
    index = [torch.tensor([5, 0, 3, 6, 2][:len(positions)])] * len(rings)
    carry = torch.randn(len(positions), config.hidden_size, generator=generator)
    return rings, maglev_cache_over_pages(config, rings, index, positions, carry, carry, model.memory_init)


@pytest.mark.parametrize("form", ["kernel", "request by request"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_maglev_ring_read_in_place_equals_the_models_decoding_attention(kv_heads, form):
    """Maglev's ring attention of a decoding step over an engine's pages, each request's ring read in place (by the
    CPU kernel, `attend_ring_kernel`, or request by request, `attend_ring_in_place`), against the model's own
    (`TokenStep.attend`: the ring gathered): the same outputs and the same pages afterwards, for requests on
    scattered pages before, at and past their window's width."""
    from kvm_maglev.models.maglev.cache_maglev import TokenStep

    if form == "kernel" and not paged_attention_cpu.available():
        pytest.skip("the CPU kernel did not build here")
    attend_in_place = {"kernel": in_place_reads.attend_ring_kernel,
                       "request by request": in_place_reads.attend_ring_in_place}[form]
    model = small_maglev(kv_heads)
    config, positions = model.config, [3, 20, 8, 1, 9]

    def cache_over_random_pages():
        rings, cache = maglev_over_random_pages(model, positions)
        return rings, cache, model.prepare_step(cache, torch.zeros(len(positions), 1, dtype=torch.long))

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), 4, 1, config.head_dim, generator=generator)
    k, v = (torch.randn(len(positions), kv_heads, 1, config.head_dim, generator=generator) for _ in range(2))
    with torch.no_grad():
        rings, cache, step = cache_over_random_pages()
        expected = [TokenStep.attend(step, layer.self_attn, ring, q, k, v, window)
                    for layer, ring, window in zip(model.layers, cache.layers, config.decoder_windows)]
        engine_rings, engine_cache, _ = cache_over_random_pages()
        got = [attend_in_place(q, k, v, ring) for ring in engine_cache.layers]
    for ours, reference in zip(got, expected):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    for ours, reference in zip(engine_rings, rings):
        for name in ("keys", "values"):
            torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=0)


@pytest.mark.parametrize("form", ["kernel", "request by request"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_maglev_recurrent_prompt_reading_rings_in_place_equals_gathering_them(kv_heads, form, monkeypatch):
    """A recurrent prompt step over an engine's pages (rows of different token counts, one starting fresh, as
    `VllmMaglevForCausalLM.run_rows` runs them): with every one-token step reading its rings in place (by the
    kernel, or request by request) the same head inputs, carries and pages as with every ring gathered; the layers
    (one window, one index tensor) share each step's read extents."""
    model = small_maglev(kv_heads)
    positions, counts = [3, 0, 8, 1, 19], [5, 7, 1, 3, 2]
    width = max(counts)
    tokens = torch.randint(0, model.config.vocab_size, (len(counts), width), generator=torch.Generator().manual_seed(5))
    valid = torch.arange(width)[None] < torch.tensor(counts)[:, None]
    calls = []
    attend_name = {"kernel": "attend_ring_kernel", "request by request": "attend_ring_in_place"}[form]
    attend_in_place, extents = getattr(in_place_reads, attend_name), in_place_reads.ring_reads

    def counted(*args):
        calls.append(args[0].shape[0])
        return attend_in_place(*args)
    monkeypatch.setattr(in_place_reads, attend_name, counted)
    extent_calls = []
    monkeypatch.setattr(in_place_reads, "ring_reads", lambda ring: extent_calls.append(1) or extents(ring))
    results = []
    for arm in (form, "gathered"):
        read_pages(arm, monkeypatch)
        rings, cache = maglev_over_random_pages(model, positions)
        with torch.no_grad():
            hidden = model(input_ids=tokens, past_key_values=cache, use_cache=True, attention_mask=valid.long(),
                           return_dict=True).last_hidden_state[valid]
        results.append([hidden, cache.last_memory, cache.previous_embedding]
                       + [ring[name] for ring in rings for name in ("keys", "values")])
    assert len(calls) == width * model.config.num_hidden_layers, "a recurrent step gathered its rings"
    assert len(extent_calls) == width, "the layers of a step did not share its read extents"
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
