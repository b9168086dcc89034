"""The CPU kernels of the decoding step over an engine's pages (kvm_maglev.vllm.paged_attention_cpu): the attention
(KVM's form `in_place_reads.state_window_attention_kernel`) against the torch reference that gathers the pages
(`state_window_attention_torch`), the token shift against its torch form and the model's (decode_kvm with the
kernel off), on pages laid out as the engine binds them; the build (cached, atomic, refused cleanly without a
compiler) and the refusal of indices outside the pages. Maglev's form is tested against the model's attention in
tests/vllm/test_engine_decode.py."""

import logging

import pytest
import torch

from kvm_maglev.models.common.row_storage import RowStorage
from kvm_maglev.models.common.step_plan import RowTokens
from kvm_maglev.models.kvm import step_plan_kvm
from kvm_maglev.models.kvm.decode_attention_kvm import state_window_attention_torch
from kvm_maglev.vllm import decode_kvm, paged_attention_cpu
from kvm_maglev.vllm.in_place_reads import state_window_attention_kernel
from kvm_maglev.vllm.page_caches import bind_pages
from kvm_maglev.vllm.paged_attention_cpu import PagedSegment, attend_segments
from tests.models.kvm.test_decode_attention import decode_inputs

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="the CPU kernel did not build here")


def as_engine_pages(inputs: dict) -> dict:
    """The same inputs with each page tensor a view into one padded byte row per page, as vLLM binds state pages
    (a page's stride larger than its tensor; the tensors side by side in the row)."""
    names = ("state_keys", "state_values", "window_keys", "window_values")
    pages, dtype = inputs[names[0]].shape[0], inputs[names[0]].dtype
    sizes = [inputs[name][0].numel() for name in names]
    rows = torch.zeros(pages, sum(sizes) + 5, dtype=dtype)
    bound, offset = {}, 0
    for name, size in zip(names, sizes):
        bound[name] = rows[:, offset:offset + size].view(-1, *inputs[name].shape[1:])
        bound[name].copy_(inputs[name])
        offset += size
    return dict(inputs, **bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperatures", [False, True])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_kernel_equals_the_gathering_reference(groups, temperatures, dtype):
    """Every request's live state slots and visible ring slots, one softmax, with the states' and windows' own
    temperatures: the reference's result, on plain and on engine-bound pages, and with no state (a sliding-window
    layer)."""
    inputs = decode_inputs(groups, dtype, temperatures, seed=groups)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    for case in (inputs, as_engine_pages(inputs)):
        out = state_window_attention_kernel(**case)
        assert out.dtype == dtype and out.shape == (4, 2 * groups, 8)
        torch.testing.assert_close(out, state_window_attention_torch(**case), **tolerance)
    no_state = dict(inputs, state_keys=inputs["state_keys"][:, :, :0], state_values=inputs["state_values"][:, :, :0],
                    state_slots=inputs["state_slots"] * 0)
    torch.testing.assert_close(state_window_attention_kernel(**no_state), state_window_attention_torch(**no_state),
                               **tolerance)


def test_kernel_on_several_threads_equals_one():
    """With torch on two threads the kernel splits the requests' heads over them: the same result."""
    inputs = decode_inputs(2, torch.float32, True, seed=4, dim=16, value_dim=16, capacity=40, ring=64)
    one = state_window_attention_kernel(**inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = state_window_attention_kernel(**inputs)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, rtol=0, atol=0)


def test_indices_outside_the_pages_are_refused():
    """A page index or a read extent beyond the page tensors is refused by name, before the kernel reads memory."""
    keys = torch.randn(3, 2, 5, 4)
    q, scale = torch.randn(2, 2, 4), torch.ones(2)
    for page, length in (([0, 3], [1, 1]), ([0, 1], [6, 1])):
        segment = PagedSegment(keys, keys, torch.tensor(page), torch.tensor(length), None, scale)
        with pytest.raises(ValueError, match="outside the page tensors"):
            attend_segments(q, [segment])
    segment = PagedSegment(keys, keys, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 1]), None, scale)
    with pytest.raises(ValueError, match="contiguous int64"):
        attend_segments(q, [segment])


def bound_rows(pages: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random page tensors [pages, *shape] side by side in one padded row a page, as vLLM binds state pages."""
    sizes = [torch.Size(shape).numel() for shape in shapes]
    rows = torch.randn(pages, sum(sizes) + 3, generator=torch.Generator().manual_seed(seed)).to(dtype)
    tensors, offset = [], 1
    for shape, size in zip(shapes, sizes):
        tensors.append(rows[:, offset:offset + size].view(pages, *shape))
        offset += size
    return tensors


def kernel_and_torch(monkeypatch, run) -> None:
    """`run()` with the kernel and again with its torch form (`KVM_MAGLEV_CPU_KERNEL=0`)."""
    run()
    monkeypatch.setenv("KVM_MAGLEV_CPU_KERNEL", "0")
    run()
    monkeypatch.delenv("KVM_MAGLEV_CPU_KERNEL")


def test_token_shift_equals_its_torch_form(monkeypatch):
    """A decoding step's token shift of streams lying side by side in the carries (a column view, as
    `kvm.carry_columns` makes), engine padding after the scheduled tokens: the same outputs and carries, bit for
    bit; a page outside the carries refused."""
    generator = torch.Generator().manual_seed(3)
    x, mix = torch.randn(1, 6, 20, generator=generator), torch.rand(20, generator=generator)
    page = torch.tensor([3, 8, 1, 0])
    results = []

    def run():
        carries = bound_rows(9, [(30,)], torch.float32, seed=4)[0]
        output = torch.full_like(x, float("nan"))
        decode_kvm.decode_shift(x, mix, carries[:, 4:24], page, 4, output)
        results.append((output, carries))
    kernel_and_torch(monkeypatch, run)
    (ours, our_carries), (reference, reference_carries) = results
    assert torch.equal(ours, reference) and torch.equal(our_carries, reference_carries)
    assert not ours[:, 4:].any()
    with pytest.raises(ValueError, match="outside the carries"):
        paged_attention_cpu.shift_tokens(x, mix, bound_rows(9, [(20,)], torch.float32, 4)[0],
                                         paged_attention_cpu.ShiftRows.decoding(torch.tensor([3, 9, 1, 0])), "first",
                                         torch.empty_like(x))
    assert not paged_attention_cpu.shifts_tokens(x.bfloat16(), mix, x[0], x)  # bfloat16 keeps the torch form


@pytest.mark.parametrize("first", ["first", "zero"])
def test_prompt_token_shift_equals_the_models(first):
    """A prompt step's token shift over requests of several tokens (new ones, one continuing from its carry, one
    decoding), the streams side by side in the carries, engine padding after the tokens: the model's own
    `shift_tokens` over storage bound to the same pages gives the same outputs and carries, bit for bit."""
    generator = torch.Generator().manual_seed(6)
    starts, counts, pages = [0, 5, 0, 9], [4, 3, 1, 1], torch.tensor([6, 2, 0, 4])
    tokens = RowTokens(starts, counts, torch.device("cpu"))
    x, mix = torch.randn(1, tokens.total + 2, 20, generator=generator), torch.rand(20, generator=generator)
    reference_carries = bound_rows(8, [(30,)], torch.float32, seed=7)[0]
    storage = RowStorage()
    bind_pages(storage, {"carry.s": reference_carries[:, 4:24]}, pages)
    reference = step_plan_kvm.shift_tokens(tokens, x[:, :tokens.total], mix, storage, "s", first)
    carries = bound_rows(8, [(30,)], torch.float32, seed=7)[0]
    output = torch.full_like(x, float("nan"))
    rows = paged_attention_cpu.ShiftRows(pages, tokens.offset, tokens.count, tokens.start)
    paged_attention_cpu.shift_tokens(x, mix, carries[:, 4:24], rows, first, output)
    assert torch.equal(output[:, :tokens.total], reference) and not output[:, tokens.total:].any()
    assert torch.equal(carries, reference_carries)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache in `tmp_path`, the loaded library forgotten before and after."""
    monkeypatch.setenv("KVM_MAGLEV_CACHE", str(tmp_path))
    paged_attention_cpu.library.cache_clear()
    yield tmp_path
    paged_attention_cpu.library.cache_clear()


def test_the_build_is_cached_and_leaves_only_the_library(fresh_build):
    assert paged_attention_cpu.library() is not None
    built = sorted(path.name for path in fresh_build.iterdir())
    assert len(built) == 1 and built[0].startswith("paged_attention_cpu-") and built[0].endswith(".so")
    paged_attention_cpu.library.cache_clear()
    assert paged_attention_cpu.library() is not None
    assert sorted(path.name for path in fresh_build.iterdir()) == built


def test_without_a_working_compiler_the_torch_path_stays(fresh_build, monkeypatch, caplog):
    """A compiler that fails (or none): no kernel, a warning saying so, nothing left in the cache; turned off by
    the environment, the kernel is not used either."""
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=paged_attention_cpu.__name__):
        assert not paged_attention_cpu.available()
    assert "torch path" in caplog.text
    assert list(fresh_build.iterdir()) == []
    inputs = decode_inputs(1, torch.float32, False)
    assert not paged_attention_cpu.reads(inputs["q"], inputs["window_keys"])
    monkeypatch.delenv("CC")
    paged_attention_cpu.library.cache_clear()
    monkeypatch.setenv("KVM_MAGLEV_CPU_KERNEL", "0")
    assert not paged_attention_cpu.reads(inputs["q"], inputs["window_keys"])
