"""merge_routing_dtype: the dtype each token's most similar state slot is scored in. "float32" (the default, and
the research kvm_fp32_routing_reference mixer) against "model" (scores of bfloat16-rounded keys, as the research
kvm_mixer computes them in bfloat16): they pick other slots where bfloat16 ties or flips the scores."""

from __future__ import annotations

import pytest
import torch

from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.state_kvm import most_similar_slot

BASE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, rotary_dim=4, chunk_size=8,
            window_chunks=2, state_budget_mode="fixed", state_budget_min=8, state_max_chunks=1)


def allowed_past(protected: int, slots: int) -> torch.Tensor:
    """Every slot allowed but the first `protected` (the sinks)."""
    return (torch.arange(slots) >= protected).view(1, 1, 1, slots)


def test_bfloat16_scores_tie_where_float32_scores_do_not():
    reference = torch.tensor([[1.0, 0.0], [1.001, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)  # 1.001 is 1.0 in bfloat16
    keys = torch.tensor([[1.0, 0.0]]).view(1, 1, 1, 2)
    assert most_similar_slot(keys, reference, allowed_past(0, 3), torch.float32).item() == 1
    assert most_similar_slot(keys, reference, allowed_past(0, 3), torch.bfloat16).item() == 0  # the first of a tie


def test_float32_routing_is_the_argmax_of_exact_scores():
    generator = torch.Generator().manual_seed(0)
    keys, slots = torch.randn(2, 2, 256, 16, generator=generator), torch.randn(2, 2, 8, 16, generator=generator)
    reference = torch.cat([slots, slots + 0.003 * torch.randn(slots.shape, generator=generator)], dim=2)  # near pairs
    exact = torch.matmul(keys.double(), reference.double().transpose(-1, -2))
    exact[..., :1] = float("-inf")
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-5  # where float32 rounding cannot decide
    assert clear.float().mean() > 0.95
    chosen = most_similar_slot(keys, reference, allowed_past(1, 16), torch.float32)
    assert torch.equal(chosen[clear], exact.argmax(dim=-1, keepdim=True)[clear])
    in_bf16 = most_similar_slot(keys, reference, allowed_past(1, 16), torch.bfloat16)
    assert (in_bf16[clear] != chosen[clear]).any()  # bfloat16 scores flip some of the clear decisions


def bf16_model(routing: str | None) -> KVMForCausalLM:
    torch.manual_seed(0)
    extra = {} if routing is None else {"merge_routing_dtype": routing}
    model = KVMForCausalLM(KVMConfig(**BASE, **extra)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.to(torch.bfloat16)


def state_after(model: KVMForCausalLM, ids: torch.Tensor, prefill: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        if prefill is None:
            cache = returned_cache(model(ids, use_cache=True))
        else:
            cache = returned_cache(model(ids[:, :prefill], use_cache=True))
            for pos in range(prefill, ids.shape[1]):
                model(ids[:, pos : pos + 1], cache=cache)
    return cache.layers[0].tensors["state_keys"][:, :, :cache.layers[0].live_slots(ids.shape[1])]


def test_switch_changes_bfloat16_slots_and_default_is_float32():
    ids = torch.randint(0, 61, (1, 200), generator=torch.Generator().manual_seed(3))
    default, float32, model = (state_after(bf16_model(r), ids) for r in (None, "float32", "model"))
    assert torch.equal(default, float32)  # existing checkpoints keep their routing
    assert not torch.equal(model, float32)  # some token merged into another slot


@pytest.mark.parametrize("routing", ["float32", "model"])
def test_folds_of_decoding_steps_score_like_the_full_forward(routing):
    model = bf16_model(routing)
    ids = torch.randint(0, 61, (1, 120), generator=torch.Generator().manual_seed(4))
    assert torch.equal(state_after(model, ids, prefill=5), state_after(model, ids))


def test_invalid_routing_dtype():
    with pytest.raises(ValueError, match="merge_routing_dtype='bfloat16'.*one of \\('float32', 'model'\\)"):
        KVMConfig(**BASE, merge_routing_dtype="bfloat16")
