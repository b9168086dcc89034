"""The row-block causal-LM loss against transformers' ForCausalLMLoss (the reference): same loss and gradient
for every argument it takes, and the models use it unless the user chose another loss."""

import copy

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from kvm_maglev.package_only import row_block_loss
from kvm_maglev.package_only.row_block_loss import row_block_causal_lm_loss
from tests.generation.testers import TESTERS

VOCAB = 250


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of four rows (of VOCAB columns), so that every loss below runs over several."""
    monkeypatch.setattr(row_block_loss, "BLOCK_ELEMENTS", 4 * VOCAB)


def loss_and_grad(loss_fn, logits, labels, **kwargs):
    logits = logits.detach().requires_grad_()
    loss = loss_fn(logits=logits, labels=labels, vocab_size=VOCAB, **kwargs)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 23}, {"num_items_in_batch": torch.tensor(31)},
                                    {"ignore_index": 7}], ids=["mean", "sum_int", "sum_tensor", "ignore_index"])
def test_loss_and_gradient_equal_transformers(dtype, kwargs):
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 19, VOCAB)).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 19))
    labels[0, :6] = kwargs.get("ignore_index", -100)
    labels[2, 3] = kwargs.get("ignore_index", -100)
    expected, expected_grad = loss_and_grad(ForCausalLMLoss, logits, labels, **kwargs)
    loss, grad = loss_and_grad(row_block_causal_lm_loss, logits, labels, **kwargs)
    assert loss.dtype == expected.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), expected_grad.float(), rtol=1e-5, atol=1e-7)


def test_given_shift_labels_are_used_as_they_are():
    torch.manual_seed(1)
    logits, labels = torch.randn(2, 9, VOCAB), torch.randint(0, VOCAB, (2, 9))
    shifted = torch.randint(0, VOCAB, (2, 9))
    expected, expected_grad = loss_and_grad(ForCausalLMLoss, logits, labels, shift_labels=shifted)
    loss, grad = loss_and_grad(row_block_causal_lm_loss, logits, labels, shift_labels=shifted)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_every_label_ignored_gives_nan_like_transformers():
    labels = torch.full((1, 5), -100)
    assert torch.isnan(ForCausalLMLoss(torch.randn(1, 5, VOCAB), labels, VOCAB))
    assert torch.isnan(row_block_causal_lm_loss(torch.randn(1, 5, VOCAB), labels, VOCAB))


def test_row_blocks_cover_every_row_once():
    assert row_block_loss.row_blocks(10, VOCAB) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert row_block_loss.row_blocks(3, 100 * VOCAB) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def assert_trains_like_the_plain_loss(model, **inputs) -> None:
    """One backward with the model's default loss and one with transformers' ForCausalLMLoss set as the
    user's loss: the same loss and gradients."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    model.loss_function = ForCausalLMLoss
    expected, expected_grads = step()
    torch.testing.assert_close(loss, expected)
    assert grads.keys() == expected_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], expected_grads[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", sorted(TESTERS))
def test_models_train_with_it_and_agree_with_the_plain_loss(name):
    """A training step (lifted passes for Maglev) gives the loss and gradients of transformers' loss."""
    tester = TESTERS[name]
    model = copy.deepcopy(tester.model(next(iter(tester.variants)))).train()
    assert model.loss_function is row_block_causal_lm_loss
    ids = tester.random_ids(2, 3 * tester.block + 1)
    labels = ids.clone()
    labels[0, :2] = -100
    assert_trains_like_the_plain_loss(model, input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))


def test_a_chosen_loss_type_is_left_to_transformers():
    model = copy.deepcopy(TESTERS["kvm"].model("power_law"))
    assert model.loss_function is row_block_causal_lm_loss
    model.loss_type = "ForMaskedLM"
    assert model.loss_function is not row_block_causal_lm_loss


@pytest.fixture
def small_head_blocks(monkeypatch):
    """Head blocks of three rows of VOCAB columns."""
    monkeypatch.setattr(row_block_loss, "HEAD_BLOCK_ELEMENTS", 3 * VOCAB)


def head_case(seed: int, kwargs: dict) -> tuple:
    """Hidden states, a head weight with 14 padding rows, labels with ignored positions, and the loss's
    keyword arguments (`shift_labels: "given"` made into random shifted labels)."""
    torch.manual_seed(seed)
    hidden = torch.randn(2, 13, 16, requires_grad=True)
    weight = (0.5 * torch.randn(VOCAB + 14, 16)).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 13))
    labels[0, :4] = -100
    if kwargs.get("shift_labels") == "given":
        kwargs = {"shift_labels": torch.randint(0, VOCAB, (2, 13))}
    return hidden, weight, labels, kwargs


@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 29}, {"shift_labels": "given"}],
                         ids=["mean", "sum", "shift_labels"])
def test_head_loss_equals_the_loss_of_the_logits(small_head_blocks, softcap, kwargs):
    """From hidden states and the padded head weight: the loss and gradients of transformers' loss on the
    logits softcap(hidden @ weight[:vocab].T), padded rows of the weight getting no gradient."""
    hidden, weight, labels, kwargs = head_case(2, kwargs)
    logits = (hidden @ weight[:VOCAB].T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = row_block_loss.row_block_head_loss(hidden, weight, labels, VOCAB, softcap, **kwargs)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert not grads[1][VOCAB:].any()


def test_head_loss_without_gradients_computes_only_the_loss():
    hidden, weight = torch.randn(1, 5, 8), torch.randn(VOCAB, 8)
    labels = torch.randint(0, VOCAB, (1, 5))
    expected = ForCausalLMLoss(hidden @ weight.T, labels, VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(row_block_loss.row_block_head_loss(hidden, weight, labels, VOCAB), expected)


def test_head_loss_with_a_frozen_head_gives_the_hidden_gradient_only():
    """A frozen head (LoRA fine-tuning) gets no gradient; the hidden states still get theirs."""
    hidden = torch.randn(1, 7, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8)
    labels = torch.randint(0, VOCAB, (1, 7))
    (expected,) = torch.autograd.grad(ForCausalLMLoss(hidden @ weight.T, labels, VOCAB), hidden)
    (grad,) = torch.autograd.grad(row_block_loss.row_block_head_loss(hidden, weight, labels, VOCAB), hidden)
    torch.testing.assert_close(grad, expected)


def test_only_a_plain_unhooked_linear_head_is_read_outside_its_forward():
    head = torch.nn.Linear(8, 4, bias=False)
    assert row_block_loss.is_plain_linear(head)
    handle = head.register_forward_pre_hook(lambda module, args: None)  # as DeepSpeed ZeRO-3 gathers weights
    assert not row_block_loss.is_plain_linear(head)
    handle.remove()
    head._hf_hook = object()  # accelerate's device placement
    assert not row_block_loss.is_plain_linear(head)
    assert not row_block_loss.is_plain_linear(type("AdapterLinear", (torch.nn.Linear,), {})(8, 4))


def test_maglev_self_fed_passes_train_like_the_plain_loss(small_head_blocks):
    """Self-fed passes take their loss from hidden states: the loss and every gradient equal those of
    transformers' loss over each pass's logits (a loss the user sets takes that path)."""
    model = copy.deepcopy(TESTERS["maglev"].model("recurrent", memory_self_feed_steps=2)).train()
    ids = TESTERS["maglev"].random_ids(2, 30)
    labels = ids.clone()
    labels[1, :5] = -100
    assert_trains_like_the_plain_loss(model, input_ids=ids, labels=labels)


def test_head_loss_products_are_counted_by_torch_flop_counter():
    """Its three products (logits, and the two gradients formed in the forward) are visible to
    torch.utils.flop_counter, which the training benchmark divides the time by."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden = torch.randn(1, 9, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        row_block_loss.row_block_head_loss(hidden, weight, torch.randint(0, VOCAB, (1, 9)), VOCAB).backward()
    assert counter.get_total_flops() == 3 * 2 * 9 * 8 * VOCAB


def plain_logits(hidden, weight, softcap, float32_logits):
    """The logits as the models' plain path makes them: the head, float32 if asked, then the cap."""
    logits = torch.nn.functional.linear(hidden, weight[:VOCAB])
    logits = logits.float() if float32_logits else logits
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("float32_logits", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 29}, {"shift_labels": "given"}],
                         ids=["mean", "sum", "shift_labels"])
def test_logits_and_loss_equal_the_plain_head_and_loss(small_head_blocks, softcap, float32_logits, kwargs):
    """The same logits as the head (and cap), the loss of transformers' loss on them, and the same gradients of
    the hidden states and the padded head weight, whose padding rows get none."""
    hidden, weight, labels, kwargs = head_case(3, kwargs)
    expected_logits = plain_logits(hidden, weight, softcap, float32_logits)
    expected = ForCausalLMLoss(expected_logits, labels, VOCAB, **kwargs)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    logits, loss = row_block_loss.row_block_logits_and_loss(hidden, weight, labels, VOCAB, softcap, float32_logits,
                                                            **kwargs)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert torch.equal(logits, expected_logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert not grads[1][VOCAB:].any()


@pytest.mark.parametrize("use", ["logits_and_loss", "logits_only"])
def test_logits_and_loss_pass_on_a_gradient_the_logits_get_elsewhere(small_head_blocks, use):
    """A second loss on the returned logits (distillation, a penalty) reaches the hidden states and the weight
    as it does through the plain head; so does a loss on the logits alone."""
    torch.manual_seed(4)
    hidden = torch.randn(1, 11, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 11))

    def total(logits, loss):
        penalty = logits.square().mean()
        return penalty + loss if use == "logits_and_loss" else penalty

    expected_logits = plain_logits(hidden, weight, 20.0, False)
    expected = total(expected_logits, ForCausalLMLoss(expected_logits, labels, VOCAB))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    grads = torch.autograd.grad(total(*row_block_loss.row_block_logits_and_loss(hidden, weight, labels, VOCAB, 20.0)),
                                (hidden, weight))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_logits_and_loss_under_bfloat16_autocast_match_the_plain_path(small_head_blocks):
    """Under autocast (Trainer's bf16 on CPU) the head's product runs in bfloat16 as nn.Linear's does: the same
    logits, and gradients within bfloat16 rounding (the weight's summed in float32 here)."""
    torch.manual_seed(5)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_logits = plain_logits(hidden, weight, None, False)
        expected = ForCausalLMLoss(expected_logits, labels, VOCAB)
        logits, loss = row_block_loss.row_block_logits_and_loss(hidden, weight, labels, VOCAB)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected_logits)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grad, rtol=2e-2, atol=2e-3)


def test_logits_and_loss_refuse_labels_of_another_length():
    with pytest.raises(ValueError, match="labels give 12 targets for 6 positions"):
        row_block_loss.row_block_logits_and_loss(torch.randn(2, 3, 8), torch.randn(VOCAB, 8),
                                                 torch.zeros(2, 6, dtype=torch.long), VOCAB)


def test_logits_and_loss_products_are_counted_by_torch_flop_counter(small_head_blocks):
    """The logits' product and the two gradient products, made block by block in the backward."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden = torch.randn(1, 9, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        row_block_loss.row_block_logits_and_loss(hidden, weight, torch.randint(0, VOCAB, (1, 9)), VOCAB)[1].backward()
    assert counter.get_total_flops() == 3 * 2 * 9 * 8 * VOCAB


@pytest.mark.parametrize("name", sorted(TESTERS))
def test_models_take_logits_and_loss_together_only_with_the_default_loss_and_a_plain_head(name, monkeypatch):
    """The returned pass goes through row_block_logits_and_loss when labels are given; a loss the user sets,
    or a head that is not a plain linear layer, takes the plain head and loss_function."""
    tester = TESTERS[name]
    model = copy.deepcopy(tester.model(next(iter(tester.variants)))).train()
    calls = []
    original = row_block_loss.RowBlockLogitsCrossEntropy.forward
    monkeypatch.setattr(row_block_loss.RowBlockLogitsCrossEntropy, "forward",
                        staticmethod(lambda *args: calls.append(1) or original(*args)))
    ids = tester.random_ids(1, tester.block + 3)
    model(input_ids=ids)
    assert not calls
    model(input_ids=ids, labels=ids)
    assert len(calls) == 1
    model.lm_head.register_forward_hook(lambda module, args, output: None)
    model(input_ids=ids, labels=ids)
    assert len(calls) == 1
