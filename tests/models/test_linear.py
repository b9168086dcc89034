"""The models' linear layers (oneDNN for float32 CPU inference) compute what nn.Linear computes, and choose
oneDNN only with their `onednn` flag on."""

import pytest
import torch

from kvm_maglev.models.speedups import onednn_linear
from kvm_maglev.models.speedups import onednn_linear as maglev_onednn_linear

OneDNNLinear, MaglevOneDNNLinear = onednn_linear.OneDNNLinear, maglev_onednn_linear.OneDNNLinear

SHAPES = [(1, 1), (2, 1), (8, 1), (1, 7), (3, 20), (70, 1), (0, 3)]


def switched_on(layer):
    """`layer` with its oneDNN call site chosen, as `onednn_linears()` chooses it."""
    layer.onednn = True
    return layer


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_inference_matches_linear(linear_class, shape, bias):
    torch.manual_seed(0)
    layer = switched_on(linear_class(1024, 601, bias=bias))  # above ONEDNN_MIN_WEIGHTS: the oneDNN path
    x = torch.randn(*shape, 1024)
    with torch.no_grad():
        out = layer(x)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
def test_non_contiguous_input(linear_class):
    layer = switched_on(linear_class(1024, 601, bias=False))
    x = torch.randn(4, 2048)[:, ::2]
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
def test_training_bfloat16_small_layers_and_no_onednn_take_nn_linear(linear_class, monkeypatch):
    torch.manual_seed(0)
    layer = switched_on(linear_class(1024, 601, bias=False))
    x = torch.randn(3, 1024, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))
    grads = torch.autograd.grad(out.sum(), (x, layer.weight))
    assert all(g is not None for g in grads)
    half = switched_on(linear_class(1024, 601, bias=False).to(torch.bfloat16))
    xb = torch.randn(4, 1024, dtype=torch.bfloat16)
    small = switched_on(linear_class(16, 40, bias=False))
    xs = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(half(xb), torch.nn.functional.linear(xb, half.weight))
        assert torch.equal(small(xs), torch.nn.functional.linear(xs, small.weight))
    module = packing_module(linear_class)
    monkeypatch.setattr(module, "ONEDNN_LINEAR", None)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
def test_the_flag_chooses_the_product(linear_class, monkeypatch):
    """Flag off (the class default, outside `onednn_linears()`): nn.Linear's product bit for bit and no oneDNN
    call; flag on: the oneDNN call, equal up to rounding."""
    torch.manual_seed(0)
    layer = linear_class(1024, 601, bias=True)
    x = torch.randn(3, 1024)
    module = packing_module(linear_class)
    if module.ONEDNN_LINEAR is None:
        pytest.skip("torch built without oneDNN")
    calls, real = [], module.ONEDNN_LINEAR
    monkeypatch.setattr(module, "ONEDNN_LINEAR", lambda *args: calls.append(args[0].shape) or real(*args))
    with torch.no_grad():
        plain = layer(x)
        assert not calls and torch.equal(plain, torch.nn.functional.linear(x, layer.weight, layer.bias))
        fast = switched_on(layer)(x)
    assert calls == [(3, 1024)]
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_the_block_switches_plain_linears_and_restores_them():
    """Inside `onednn_linears()` an nn.Linear with a plain weight is a OneDNNLinear holding the very same
    parameters and attributes, computing F.linear up to rounding; after it, an nn.Linear again, nothing left."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 601), torch.nn.Linear(601, 8))
    model[0]._is_hf_initialized = True
    weights = [layer.weight for layer in model]
    x = torch.randn(3, 1024)
    with torch.no_grad():
        plain = model(x)
        with onednn_linear.onednn_linears(model):
            assert all(type(layer) is OneDNNLinear and layer.onednn for layer in model)
            assert [layer.weight for layer in model] == weights and model[0]._is_hf_initialized
            fast = model(x)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    assert all(type(layer) is torch.nn.Linear and not {"onednn", "packed"} & set(vars(layer)) for layer in model)


class QuantizedStandIn(torch.Tensor):
    """A tensor subclass standing in for a quantized weight (torchao's report their float dtype and shape)."""


def test_the_block_leaves_quantized_and_subclassed_linears_alone(monkeypatch):
    """A weight that is a tensor subclass, a Linear subclass (bitsandbytes', PEFT's) and a non-strided weight stay
    as they are: their own kernels compute them, never oneDNN's reorder or product."""
    monkeypatch.setattr(onednn_linear, "ONEDNN_LINEAR", lambda *args: pytest.fail("oneDNN took a quantized weight"))
    subclassed = torch.nn.Linear(1024, 601)
    subclassed.weight = torch.nn.Parameter(subclassed.weight.detach().as_subclass(QuantizedStandIn))

    class OwnLinear(torch.nn.Linear):
        pass

    own = OwnLinear(1024, 601)
    model = torch.nn.ModuleList([subclassed, own])
    x = torch.randn(2, 1024)
    with torch.no_grad(), onednn_linear.onednn_linears(model):
        assert type(subclassed) is torch.nn.Linear and type(own) is OwnLinear
        assert torch.equal(own(x), torch.nn.functional.linear(x, own.weight, own.bias))
        subclassed(x)
    assert not onednn_linear.switchable(subclassed) and not onednn_linear.switchable(own)
    # a OneDNNLinear built directly (the vLLM plugin's) whose weight became a subclass takes nn.Linear's product
    direct = switched_on(OneDNNLinear(1024, 601))
    direct.weight = torch.nn.Parameter(direct.weight.detach().as_subclass(QuantizedStandIn))
    with torch.no_grad():
        direct(x)


def test_onednn_is_used_on_this_machine():
    """Guards the speed path itself: on an x86 torch build the oneDNN op is there and differs from MKL's
    summation order only at float rounding."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert onednn_linear.ONEDNN_LINEAR is not None and maglev_onednn_linear.ONEDNN_LINEAR is not None


def packing_module(linear_class):
    return onednn_linear if linear_class is OneDNNLinear else maglev_onednn_linear


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
@pytest.mark.parametrize("rows", [1, 2, 8, 64, 65])
def test_blocked_copy_matches_linear(linear_class, rows):
    """Inside a packing block, 2-64 row products read a blocked copy of the weight and still compute F.linear."""
    if packing_module(linear_class).ONEDNN_PACK is None:
        pytest.skip("torch without oneDNN's weight reordering")
    torch.manual_seed(0)
    layer = switched_on(linear_class(1024, 601, bias=True))
    x = torch.randn(rows, 1024)
    with torch.inference_mode():
        out = layer(x)
    assert (layer.packed is not None) == (1 < rows <= 64)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
def test_blocked_copy_follows_in_place_writes(linear_class):
    if packing_module(linear_class).ONEDNN_PACK is None:
        pytest.skip("torch without oneDNN's weight reordering")
    torch.manual_seed(0)
    layer = switched_on(linear_class(1024, 601, bias=False))
    x = torch.randn(8, 1024)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)
        out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def big_head_models():
    """A tiny KVM and a tiny Maglev whose vocabulary heads are large enough (2^19 weights) to be packed."""
    from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
    from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM

    torch.manual_seed(0)
    kvm = KVMForCausalLM(KVMConfig(vocab_size=16384, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   rotary_dim=8, chunk_size=4, window_chunks=2, state_budget_min=4))
    maglev = MaglevForCausalLM(MaglevConfig(vocab_size=8192, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                            window_pattern="SL", prefiller_window_pattern="SL"))
    for model in (kvm, maglev):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.3 * torch.randn_like(param))
    return {"kvm": kvm.eval(), "maglev": maglev.eval()}


@pytest.mark.parametrize("name", ["kvm", "maglev"])
def test_batched_generate_reads_blocked_copies_and_agrees(name, monkeypatch):
    """generate() on a batch packs the head once, frees it after, and scores as the unpacked path does."""
    model = big_head_models()[name]
    module = onednn_linear if name == "kvm" else maglev_onednn_linear
    if module.ONEDNN_PACK is None:
        pytest.skip("torch without oneDNN's weight reordering")
    ids = torch.randint(1, 8192, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_scores=True,
                    return_dict_in_generate=True, pad_token_id=0)
    packs = []
    real_pack = module.ONEDNN_PACK
    monkeypatch.setattr(module, "ONEDNN_PACK", lambda weight, rows: packs.append(rows) or real_pack(weight, rows))
    packed = model.generate(ids, **settings)
    assert packs == [3]  # the head only (the other layers are small), once for the whole generation
    assert type(model.lm_head) is torch.nn.Linear and "packed" not in vars(model.lm_head)
    monkeypatch.setattr(module, "ONEDNN_PACK", None)
    plain = model.generate(ids, **settings)
    assert torch.equal(packed.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(packed.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-4)


def test_nested_packing_blocks_free_the_copy_at_the_outermost_end():
    model = big_head_models()["kvm"]
    if onednn_linear.ONEDNN_PACK is None:
        pytest.skip("torch without oneDNN's weight reordering")
    with torch.no_grad(), model.runtime_speedups():
        with model.runtime_speedups():
            model.lm_head(torch.randn(4, 32))
        assert model.lm_head.packed is not None
    assert type(model.lm_head) is torch.nn.Linear and not {"onednn", "packed"} & set(vars(model.lm_head))


@pytest.mark.parametrize("linear_class", [OneDNNLinear, MaglevOneDNNLinear])
def test_torch_compile_leaves_the_product_to_inductor(linear_class):
    """Inductor cannot lower a oneDNN call on a weight it does not own; compiled, the layer is nn.Linear."""
    torch.manual_seed(0)
    layer = switched_on(linear_class(1024, 601))
    x = torch.randn(3, 1024)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer)(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,backend", [("kvm", "inductor"), ("maglev", "aot_eager")])
def test_compiled_model_matches_eager(name, backend):
    """torch.compile(model) traces the model as eager computes it; KVM through inductor, its vocabulary head
    on the oneDNN path when eager (Maglev's linears are the same code, and inductor on its graphs takes 50 s)."""
    model = big_head_models()[name]
    ids = torch.randint(1, 4096, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend=backend)
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-4)
