"""Training under CPU autocast (bfloat16, float16), as `Trainer(bf16=True)` and TRL's trainers run it:
every training path (unpadded, padded, gradient checkpointing) of both models gives a finite loss and
gradients close to the float32 run's, within the low-precision tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvm_maglev.models.common.activation_checkpointing import enable_activation_checkpointing
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from tests.models.maglev.test_maglev_model import VOCAB as MAGLEV_VOCAB
from tests.models.maglev.test_maglev_model import tiny_model

KVM_VOCAB = 53
# layer 0 a sliding-window layer, layer 1 a KVM layer whose state is read from token 8 on
KVM_CONFIG = dict(vocab_size=KVM_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8,
                  chunk_size=4, window_chunks=2, state_budget_mode="power_law", state_budget_factor=1.5,
                  state_budget_min=4, state_max_chunks=100, sliding_window_every=2)
# relative error of all gradients together / of one parameter's (against its norm plus 1% of the total); bf16's
# per-parameter bound leaves room for KVM's merge gate, whose gradient over padded rows reaches 0.15 (10 left, 1 right)
TOLERANCE = {torch.bfloat16: dict(loss=0.02, whole=0.05, each=0.2),
             torch.float16: dict(loss=0.005, whole=0.01, each=0.03)}


def kvm_model() -> KVMForCausalLM:
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**KVM_CONFIG))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


MODELS = {"kvm": (kvm_model, KVM_VOCAB, 40), "maglev": (tiny_model, MAGLEV_VOCAB, 24)}


def batch(vocab: int, length: int, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Two rows, row 0 with `left` padding tokens in front, row 1 with `right` behind (no mask when none)."""
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))
    if left == right == 0:
        return ids, None, ids
    mask = torch.ones_like(ids)
    mask[0, :left] = 0
    mask[1, length - right:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def loss_and_gradients(kind: str, dtype: torch.dtype, left: int, right: int, checkpointing: bool) -> tuple:
    make, vocab, length = MODELS[kind]
    model = make().train()
    if checkpointing:
        enable_activation_checkpointing(model, {"use_reentrant": False})
    ids, mask, labels = batch(vocab, length, left, right)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast keeps float32 weights
    return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_close_to_float32(kind: str, dtype: torch.dtype, left: int, right: int, checkpointing: bool) -> None:
    reference_loss, reference = loss_and_gradients(kind, torch.float32, left, right, checkpointing=False)
    loss, gradients = loss_and_gradients(kind, dtype, left, right, checkpointing)
    tolerance = TOLERANCE[dtype]
    assert torch.isfinite(loss) and abs(loss.item() - reference_loss.item()) < tolerance["loss"]
    assert gradients.keys() == reference.keys() and reference
    total = torch.cat([g.flatten() for g in reference.values()]).norm()
    difference = torch.cat([(gradients[n].float() - g).flatten() for n, g in reference.items()]).norm()
    assert difference / total < tolerance["whole"]
    for name, g in reference.items():
        assert torch.isfinite(gradients[name]).all(), name
        assert (gradients[name].float() - g).norm() / (g.norm() + 0.01 * total) < tolerance["each"], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("left, right", [(0, 0), (7, 0), (0, 5), (7, 5)], ids=["unpadded", "left", "right", "both"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_autocast_training_is_close_to_float32(kind, left, right, checkpointing, dtype):
    assert_close_to_float32(kind, dtype, left, right, checkpointing)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(MODELS)), left=st.integers(0, 20), right=st.integers(0, 20))
def test_bf16_autocast_training_over_padding_lengths(kind, left, right):
    assert_close_to_float32(kind, torch.bfloat16, left, right, checkpointing=False)
