"""Maglev with the memory on (random weights, window 8): the invariants of MAGLEV.md, the cache,
generate() against the uncached path, lifted training, config validation."""

import pytest
import torch

from kvm_maglev import MaglevConfig, MaglevForCausalLM  # the package's classes: the row-block loss is theirs
from kvm_maglev.cache_sizes import cache_bytes, full_attention_cache_bytes
from kvm_maglev.models.common.activation_checkpointing import enable_activation_checkpointing
from kvm_maglev.models.common.transformers_versions import CACHE_NAME, returned_cache
from kvm_maglev.models.maglev.cache_maglev import MaglevCache

VOCAB = 97



def tiny_config(**overrides) -> MaglevConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, window_pattern="SL", sliding_window=8,
                  prefiller_window_pattern="SL", memory_gate_channels=12)
    fields.update(overrides)
    return MaglevConfig(**fields)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (gates and memory projections included) so no feature is a no-op."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:
                std = 1.0 if "embed" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "residual_lambdas" in name:
                param.copy_(0.8 + 0.4 * torch.rand(param.shape, generator=generator))
            else:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def tiny_model(seed: int = 0, **overrides) -> MaglevForCausalLM:
    torch.manual_seed(seed)
    return randomize(MaglevForCausalLM(tiny_config(**overrides)), seed).eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(model, ids, prompt_len, chunk=1):
    """Prompt in one forward, then the rest in chunks of `chunk` tokens on the same cache."""
    cache = MaglevCache(model.config)
    outputs = [model(ids[:, :prompt_len], past_key_values=cache, use_cache=True).logits]
    for start in range(prompt_len, ids.shape[1], chunk):
        outputs.append(model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(outputs, dim=1), cache


# ----- invariants ------------------------------------------------------------------------------------
@torch.no_grad()
def test_invariant2_zero_memory_projections_give_plain_sliding_window_model():
    model = tiny_model()
    for layer in model.model.layers:
        layer.self_attn.memory_k_proj.weight.zero_()
        layer.self_attn.memory_v_proj.weight.zero_()
    plain = MaglevForCausalLM(tiny_config(use_memory=False)).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("memory" in key for key in unexpected)
    ids = random_ids(2, 64)
    error = (model(ids, use_cache=False).logits - plain(ids, use_cache=False).logits).abs().max().item()
    assert error < 1e-5, error
    # and the memory is not a no-op when the projections are on
    assert (tiny_model()(ids, use_cache=False).logits - plain(ids, use_cache=False).logits).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("prompt_len,chunk", [(1, 1), (7, 1), (8, 1), (13, 5), (40, 3)])
def test_invariant3_cached_decoding_equals_uncached_recurrent_forward(prompt_len, chunk):
    model = tiny_model()
    ids = random_ids(2, 64)
    full = model(ids, use_cache=False).logits
    stepped, cache = cached_logits(model, ids, prompt_len, chunk)
    assert cache.get_seq_length() == 64
    error = (stepped - full).abs().max().item()
    assert error < 1e-5, error


@torch.no_grad()
@pytest.mark.parametrize("prompt_len,chunk", [(3, 13), (20, 5), (9, 1)])
def test_sliding_ring_chunks_equal_full_forward_memory_off(prompt_len, chunk):
    """Parallel chunks larger or smaller than the ring, on a non-empty cache (smear across chunks)."""
    model = tiny_model(use_memory=False)
    ids = random_ids(3, 50)
    stepped, cache = cached_logits(model, ids, prompt_len, chunk)
    error = (stepped - model(ids, use_cache=False).logits).abs().max().item()
    assert error < 1e-5, error
    assert cache.nbytes() == cache_bytes(model.config, 50, batch_size=3, dtype=torch.float32)


@torch.no_grad()
@pytest.mark.parametrize("shares", [True, False])
def test_invariant4_lifted_consistency(shares):
    model = tiny_model(prefiller_shares_blocks=shares)
    ids = random_ids(2, 72)
    recurrent = model.model(ids, use_cache=False)
    memories = recurrent.memories
    lifted = model.model(ids, use_cache=False, memory_inputs=model.model.shifted_memories(memories, None))
    memory_error = (lifted.memories - memories).abs().max().item()
    logit_error = (model.logits(lifted.memories) - model.logits(memories)).abs().max().item()
    assert memory_error < 2e-5 and logit_error < 2e-5, (memory_error, logit_error)


@torch.no_grad()
def test_invariant5_cache_bytes_flat_after_window():
    model = tiny_model(num_hidden_layers=2)
    cache = MaglevCache(model.config)
    sizes = {}
    ids = random_ids(1, 1000)
    for start in range(0, 1000, 50):
        model(ids[:, start:start + 50], past_key_values=cache, use_cache=True)
        sizes[start + 50] = cache.nbytes()
    assert sizes[100] == sizes[1000] > 0
    assert len(set(sizes.values())) == 1
    assert sizes[1000] == cache_bytes(model.config, 1000, batch_size=1, dtype=torch.float32)
    assert full_attention_cache_bytes(model.config, 1000, dtype=torch.float32) > sizes[1000]


# ----- cache --------------------------------------------------------------------------------------------
@torch.no_grad()
def test_cache_batch_operations_and_errors():
    model = tiny_model()
    ids = random_ids(2, 20)
    _, cache = cached_logits(model, ids, 20)
    next_ids = random_ids(2, 1, seed=5)
    reference = model(torch.cat([ids, next_ids], 1), use_cache=False).logits[:, -1]

    swapped = MaglevCache(model.config)
    model(ids, past_key_values=swapped, use_cache=True)
    swapped.reorder_cache(torch.tensor([1, 0]))
    out = model(next_ids.flip(0), past_key_values=swapped).logits[:, -1]
    assert torch.allclose(out, reference.flip(0), atol=1e-5)

    repeated = MaglevCache(model.config)
    model(ids, past_key_values=repeated, use_cache=True)
    repeated.batch_repeat_interleave(2)
    out = model(next_ids.repeat_interleave(2, 0), past_key_values=repeated).logits[:, -1]
    assert torch.allclose(out, reference.repeat_interleave(2, 0), atol=1e-5)
    repeated.batch_select_indices(torch.tensor([2]))
    assert repeated.batch_size == 1

    with pytest.raises(ValueError, match="recording is not active"):
        cache.crop(-1)
    assert cache.is_compileable is False
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


@torch.no_grad()
def test_cache_accepts_both_keyword_names_and_is_returned():
    model = tiny_model()
    ids = random_ids(1, 10)
    cache = MaglevCache(model.config)
    out = model(ids[:, :6], cache=cache, use_cache=True)
    assert getattr(out, CACHE_NAME) is cache and cache.get_seq_length() == 6
    out = model(ids[:, 6:], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 10
    assert torch.allclose(out.logits, model(ids, use_cache=False).logits[:, 6:], atol=1e-5)


@torch.no_grad()
def test_prefiller_prefill_mode():
    model = tiny_model(prefiller_shares_blocks=False, memory_prefill="prefiller")
    ids = random_ids(2, 40)
    uncached = model(ids[:, :30], use_cache=False).logits
    cached, cache = cached_logits(model, ids, 30)
    assert torch.allclose(cached[:, :30], uncached, atol=1e-5)
    # the prompt's logits come from P fed with Q's memories, not P's own
    recurrent = tiny_model(prefiller_shares_blocks=False)(ids[:, :30], use_cache=False).logits
    assert (recurrent - uncached).abs().max() > 1e-3
    # decoding continues with P's own memory: last memory is P's, as in a lifted forward
    lifted = model.model(ids[:, :30], use_cache=False, lifted=True)
    assert cache.last_memory is not None and lifted.consistency_loss is not None
    # a later multi-token step runs recurrently with P's own memory, like decoding token by token
    stepped, chunked = MaglevCache(model.config), MaglevCache(model.config)
    model(ids[:, :30], past_key_values=stepped, use_cache=True)
    model(ids[:, :30], past_key_values=chunked, use_cache=True)
    one_by_one = torch.cat([model(ids[:, t:t + 1], past_key_values=stepped).logits for t in range(30, 35)], dim=1)
    assert torch.allclose(model(ids[:, 30:35], past_key_values=chunked).logits, one_by_one, atol=1e-5)


# ----- generate ----------------------------------------------------------------------------------------
@torch.no_grad()
def test_generate_greedy_matches_uncached_loop():
    model = tiny_model()
    prompt = random_ids(2, 12)
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)
    ids = prompt
    for _ in range(12):
        next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False))


@torch.no_grad()
def test_generate_sampling_and_num_return_sequences_match_uncached():
    model = tiny_model()
    prompt = random_ids(2, 9)
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=20, num_return_sequences=2)
    torch.manual_seed(123)
    cached = model.generate(prompt, **kwargs)
    torch.manual_seed(123)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape == (4, 19)
    assert torch.equal(cached, uncached)


@torch.no_grad()
def test_beam_search_reorders_cache_like_uncached():
    model = tiny_model()
    prompt = random_ids(2, 12)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(model.generate(prompt, **kwargs), model.generate(prompt, use_cache=False, **kwargs))


# ----- training ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shares", [True, False])
def test_lifted_training_loss_decreases(shares):
    torch.manual_seed(0)
    model = MaglevForCausalLM(tiny_config(prefiller_shares_blocks=shares, consistency_weight=0.1)).train()
    # Periodic sequences: predictable from in-window context.
    base = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(3))
    ids = base.repeat(1, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(ids, labels=ids)
        assert torch.allclose(out.loss, out.lm_loss + 0.1 * out.consistency_loss)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    if not shares:
        assert model.model.prefiller_layers[0].self_attn.q_proj.weight.grad is not None


@torch.no_grad()
@pytest.mark.parametrize("memory_prefill", ["recurrent", "prefiller"])
def test_eval_labels_only_add_the_loss_of_the_inference_logits(memory_prefill):
    """In eval mode labels change nothing but the loss: the logits are generate()'s forward (P on its own memory,
    or the prefiller's prompt), and the loss is their cross-entropy, not the lifted training objective."""
    model = tiny_model(prefiller_shares_blocks=False, memory_prefill=memory_prefill, memory_self_feed_steps=1)
    ids = random_ids(2, 30)
    labels = ids.clone()
    labels[0, :4] = -100
    plain = model(ids, use_cache=False).logits
    out = model(ids, labels=labels, use_cache=False)
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    expected = torch.nn.functional.cross_entropy(plain[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100)
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-6)
    assert out.consistency_loss is None
    # the lifted objective differs, and is what training mode (or an explicit lifted=True) computes
    lifted = model(ids, labels=labels, use_cache=False, lifted=True)
    assert lifted.consistency_loss is not None and abs(lifted.loss - out.loss) > 1e-3


def test_training_loss_conventions():
    model = tiny_model(prefiller_shares_blocks=False, consistency_detach_target=True)
    model.train()
    ids = random_ids(2, 24)
    labels = ids.clone()
    labels[:, :5] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    expected = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.lm_loss, expected, atol=1e-5)
    count = int((labels[:, 1:] != -100).sum())
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(2 * count)).lm_loss
    assert torch.allclose(summed, expected / 2, atol=1e-5)
    # detaching the target changes only the consistency term's gradient into Q
    q_grads = []
    for detach in (True, False):
        model.zero_grad()
        model.config.consistency_detach_target = detach
        model(ids, labels=labels).consistency_loss.backward()
        q_grads.append(model.model.prefiller_layers[0].mlp.up_proj.weight.grad.clone())
    assert not torch.allclose(q_grads[0], q_grads[1])


def test_gradient_checkpointing_matches():
    ids = random_ids(2, 24)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            enable_activation_checkpointing(model)
            assert model.model.gradient_checkpointing
        model(ids, labels=ids).loss.backward()
        grads.append(model.model.layers[1].self_attn.memory_k_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close(dtype):
    model = tiny_model()
    ids = random_ids(1, 20)
    reference = model(ids, use_cache=False).logits
    half = model.to(dtype)(ids, use_cache=False).logits
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - reference).abs().max() < 1.0
    assert model.generate(ids[:, :5], max_new_tokens=4, do_sample=False).shape == (1, 9)


@torch.no_grad()
@pytest.mark.parametrize("switch,neutralize", [
    ("use_smear", lambda m: m.model.smear_lambda.zero_()),
    ("use_backout", lambda m: m.model.backout_lambda.zero_()),
    ("use_value_embeddings", lambda m: [t.weight.zero_() for t in m.model.value_embeddings.values()]),
    ("use_layer_lambdas", lambda m: (m.model.residual_lambdas.fill_(1.0), m.model.x0_lambdas.zero_())),
])
def test_feature_switch_off_equals_neutral_weights(switch, neutralize):
    full = tiny_model()
    neutralize(full)
    reduced = MaglevForCausalLM(tiny_config(**{switch: False})).eval()
    missing, _ = reduced.load_state_dict(full.state_dict(), strict=False)
    assert not missing
    ids = random_ids(2, 20)
    assert torch.allclose(full(ids, use_cache=False).logits, reduced(ids, use_cache=False).logits, atol=1e-5)


# ----- config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,name", [
    (dict(window_pattern="SXL"), "window_pattern"),
    (dict(prefiller_window_pattern="sq"), "prefiller_window_pattern"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_attention_heads=5), "num_attention_heads"),
    (dict(memory_prefill="prefiller", has_prefiller=False), "memory_prefill"),
    (dict(memory_prefill="parallel"), "memory_prefill"),
    (dict(consistency_loss="l1"), "consistency_loss"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(sliding_window=1), "sliding_window"),
    (dict(memory_gate_channels=100), "memory_gate_channels"),
    (dict(backout_layer=3), "backout_layer"),
])
def test_config_validation_names_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        tiny_config(**fields)


def test_config_cache_bytes_closed_form():
    config = tiny_config(use_memory=False, sliding_window=None, window_pattern="SL")
    model = randomize(MaglevForCausalLM(config)).eval()
    cache = MaglevCache(config)
    with torch.no_grad():
        model(random_ids(2, 40), past_key_values=cache, use_cache=True)
    assert cache.nbytes() == cache_bytes(config, 40, batch_size=2, dtype=torch.float32)
    assert cache_bytes(config, 0) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        cache_bytes(config, -1)


@torch.no_grad()
def test_save_and_from_pretrained_round_trip(tmp_path):
    model = tiny_model(prefiller_shares_blocks=False)
    model.save_pretrained(tmp_path)
    loaded = MaglevForCausalLM.from_pretrained(tmp_path).eval()
    ids = random_ids(1, 20)
    assert all(torch.equal(value, loaded.state_dict()[key]) for key, value in model.state_dict().items())
    assert torch.allclose(model(ids, use_cache=False).logits, loaded(ids, use_cache=False).logits, atol=1e-5)


# ----- long chunks: blocked windowed attention -----------------------------------------------------------
@pytest.mark.parametrize("padding", ["none", "left", "middle"])
def test_query_blocks_equal_one_dense_attention(monkeypatch, padding):
    """Long parallel chunks attend block by block of queries over the keys they can reach; the result is
    the dense masked attention's (lifted training with its gradients, prefiller prompt with its cache)."""
    from kvm_maglev.models.maglev import modeling_maglev

    model = tiny_model(prefiller_shares_blocks=False, memory_prefill="prefiller")
    ids = random_ids(3, 70)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :13], mask[2, :40] = 0, 0
    elif padding == "middle":
        mask[1, 20:31], mask[2, 5:9] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)

    def run():
        model.train()
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.eval()
        with torch.no_grad():
            prompt = model(ids[:, :60], attention_mask=mask[:, :60], use_cache=True)
            cache = returned_cache(prompt)
            step = model(ids[:, 60:], attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits.detach(), grads, prompt.logits, step.logits

    monkeypatch.setattr(modeling_maglev, "QUERY_BLOCK", 10**9)
    dense = run()
    monkeypatch.setattr(modeling_maglev, "QUERY_BLOCK", 8)
    blocked = run()
    real = mask.bool()
    torch.testing.assert_close(blocked[0][real], dense[0][real], atol=1e-5, rtol=1e-5)
    for name, grad in dense[1].items():
        torch.testing.assert_close(blocked[1][name], grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(blocked[2][real[:, :60]], dense[2][real[:, :60]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(blocked[3], dense[3], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("memory_prefill", ["recurrent", "prefiller"])
def test_padding_positions_do_not_see_the_next_real_token(memory_prefill):
    """A padding query carries the next real token's position; it must still not read that token, or a
    left-padded row would leak the label of its first token in training."""
    model = tiny_model(prefiller_shares_blocks=False, memory_prefill=memory_prefill)
    ids = random_ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    changed = ids.clone()
    changed[1, 10] = (ids[1, 10] + 1) % VOCAB
    for lifted in (False, True):
        before = model.model(ids, attention_mask=mask, use_cache=False, lifted=lifted).last_hidden_state
        after = model.model(changed, attention_mask=mask, use_cache=False, lifted=lifted).last_hidden_state
        torch.testing.assert_close(before[1, :10], after[1, :10])


@pytest.mark.parametrize("overrides", [
    dict(has_prefiller=True, prefiller_shares_blocks=False), dict(has_prefiller=True), dict(has_prefiller=False),
    dict(use_memory=False, has_prefiller=False), dict(use_value_embeddings=False, has_prefiller=True,
                                                        prefiller_shares_blocks=False),
], ids=["separate_prefiller", "shared_prefiller", "no_prefiller", "memory_off", "no_value_embeddings"])
def test_tensor_parallel_plan_names_only_modules_the_config_builds(overrides):
    """Every plan entry shards some linear layer of this model (transformers' own check), and every attention /
    MLP / memory linear layer of the blocks is in the plan (a missed one would stay whole on every rank)."""
    try:
        from transformers.distributed.parallel_utils import _get_parameter_plan
    except ImportError:  # transformers < 5.24
        from transformers.distributed.tensor_parallel import _get_parameter_tp_plan as _get_parameter_plan

    model = MaglevForCausalLM(tiny_config(**overrides))
    modules = [name for name, _ in model.named_modules()]
    for pattern in model.tp_plan:
        assert any(_get_parameter_plan(name, {pattern: "x"}, is_weight=False) for name in modules), pattern
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    in_blocks = [name for name in linears if ".layers." in name or "prefiller_layers." in name]
    unplanned = [name for name in in_blocks if _get_parameter_plan(name, model.tp_plan, is_weight=False) is None]
    assert unplanned == [] and in_blocks
    assert any("prefiller_layers" in pattern for pattern in model.tp_plan) == model.config.separate_prefiller
