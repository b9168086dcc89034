"""KVM's state trains only on sequences long enough to merge a block: the model warns below that length,
and the fine-tuning default block length reaches it."""

import logging

import pytest
import torch

from kvm_maglev import KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.modeling_kvm import state_training_length
from kvm_maglev.training import training_block_size


def tiny_model() -> KVMForCausalLM:
    config = KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, chunk_size=8,
                       window_chunks=2, state_budget_mode="fixed", state_budget_min=16, state_max_chunks=2)
    torch.manual_seed(0)
    model = KVMForCausalLM(config)
    with torch.no_grad():  # no zero-initialised weight may hide a gradient
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model.train()


def merge_gate_gradient(model: KVMForCausalLM, length: int) -> float:
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if "merge_gate" in name]
    assert grads
    return max(0.0 if g is None else g.abs().max().item() for g in grads)


def test_merge_gate_trains_from_the_state_training_length_on():
    model = tiny_model()
    length = state_training_length(model.config)
    assert length == 8 * 3 + 2
    assert merge_gate_gradient(model, length - 1) == 0.0
    assert merge_gate_gradient(model, length) > 0.0


def test_short_training_sequences_are_warned_about(caplog):
    model = tiny_model()
    target = logging.getLogger("kvm_maglev.models.kvm.modeling_kvm")
    target.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=target.name):
            ids = torch.zeros(1, 12, dtype=torch.long)
            model(input_ids=ids, labels=ids)
    finally:
        target.removeHandler(caplog.handler)
    assert any("merge gate" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("chunk, window, expected", [(8, 2, 128), (64, 2, 256), (256, 2, 1024)])
def test_finetune_block_size_trains_the_state(chunk, window, expected):
    config = KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       chunk_size=chunk, window_chunks=window)
    block = training_block_size(config)
    assert block == expected and block >= state_training_length(config) and block % chunk == 0
