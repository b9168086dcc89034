"""Both models follow transformers' forward and generate conventions: output switches default to the config,
return_dict=False gives transformers' tuple, attention weights and foreign attention kernels are refused with
clear errors, "eager" and "sdpa" agree, position ids are honoured (KVM) or checked (Maglev) and packed
sequences refused, generate() names the model's own cache when asked for another, and the Auto classes know the
models only after `kvm_maglev.register_auto_classes()`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

from kvm_maglev.models.common.transformers_versions import CACHE_NAME
from kvm_maglev.models.kvm import KVMCache, KVMConfig, KVMForCausalLM
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM

VOCAB = 61
# long enough that KVM blocks have left the window into the state (chunk 4, 2 window chunks) and that Maglev's
# window (8) has slid past the first tokens, so the state and the memory are read
LENGTH = 24
KVM_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8,
                  chunk_size=4, window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0,
                  state_budget_min=4, state_max_chunks=100)
MAGLEV_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32, window_pattern="SL", sliding_window=8,
                     prefiller_window_pattern="SL", memory_gate_channels=12)
MODELS = {"kvm": (KVMForCausalLM, KVMConfig, KVM_CONFIG, KVMCache),
          "maglev": (MaglevForCausalLM, MaglevConfig, MAGLEV_CONFIG, MaglevCache)}


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random at a trained model's scale (zero-initialised gates and outputs included)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = (1.0 if "embed" in name else param.shape[1] ** -0.5) if param.ndim == 2 else 0.3
            param.copy_((1.0 if param.ndim < 2 and "lambda" in name else 0.0)
                        + std * torch.randn(param.shape, generator=generator))
    return model.eval()


def tiny(kind: str, **overrides):
    model_class, config_class, fields, _ = MODELS[kind]
    torch.manual_seed(0)
    return randomized(model_class(config_class(**{**fields, **overrides})))


def ids(batch: int = 2, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_of(model, tokens, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, **kwargs).logits


kinds = pytest.mark.parametrize("kind", sorted(MODELS))


# ---- output switches and tuples ------------------------------------------------------------
@kinds
def test_output_switches_default_to_the_config(kind):
    model, tokens = tiny(kind), ids()
    assert logits_of(model, tokens) is not None and model(tokens).hidden_states is None
    model.config.output_hidden_states = True
    hidden = model(tokens).hidden_states
    assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
    assert model.model(tokens).hidden_states is not None
    assert model(tokens, output_hidden_states=False).hidden_states is None
    model.config.output_hidden_states = False
    model.config.use_cache = False
    assert getattr(model(tokens), CACHE_NAME) is None
    assert getattr(model(tokens, use_cache=True), CACHE_NAME) is not None


@kinds
def test_return_dict_false_returns_transformers_tuple(kind):
    model, tokens = tiny(kind), ids()
    expected = logits_of(model, tokens)
    with torch.no_grad():
        logits, cache = model(tokens, return_dict=False)
        loss, labelled_logits, *_ = model(tokens, labels=tokens, return_dict=False)
        labelled = model(tokens, labels=tokens)  # Maglev trains its lifted pass: logits of their own
        hidden = model.model(tokens, return_dict=False)[0]
    assert isinstance(cache, MODELS[kind][3]) and loss.ndim == 0
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    torch.testing.assert_close((loss, labelled_logits), (labelled.loss, labelled.logits), rtol=0, atol=0)
    assert hidden.shape == (*tokens.shape, model.config.hidden_size)
    model.config.return_dict = False
    with torch.no_grad():
        out = model(tokens)
        assert isinstance(out, tuple) and len(out) == 2
        assert not isinstance(model(tokens, return_dict=True), tuple)


# ---- attention: weights refused, implementations ---------------------------------------------
@kinds
def test_output_attentions_refused_clearly(kind):
    model, tokens = tiny(kind), ids()
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(tokens, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model.model(tokens, output_attentions=True)
    model.set_attn_implementation("eager")  # transformers lets the config ask for weights only under eager
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(tokens)
    model.config.output_attentions = False
    # assisted decoding asks the model for attention weights: a clear error, not transformers' TypeError
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model.generate(tokens[:1, :6], assistant_model=tiny(kind), max_new_tokens=3, do_sample=False,
                       output_attentions=True, return_dict_in_generate=True)


@kinds
def test_eager_and_sdpa_agree_and_take_their_own_paths(kind, monkeypatch):
    model = tiny(kind)
    tokens, mask = ids(), torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :5] = 0  # a left-padded row: the masks of both paths see padding
    fused_calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    assert model.config._attn_implementation == "sdpa"
    sdpa_logits = logits_of(model, tokens, attention_mask=mask)
    assert fused_calls
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    fused_calls.clear()
    eager_logits = logits_of(model, tokens, attention_mask=mask)
    assert not fused_calls  # the eager path spells the products out
    real = mask.bool()
    torch.testing.assert_close(eager_logits[real], sdpa_logits[real], rtol=0, atol=1e-5)
    loaded = tiny(kind, attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    torch.testing.assert_close(logits_of(loaded, tokens, attention_mask=mask)[real], eager_logits[real],
                               rtol=0, atol=0)


@kinds
@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "paged|eager"])
def test_other_attention_implementations_refused_at_load_and_on_switch(kind, implementation, tmp_path):
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' is not supported"):
        tiny(kind, attn_implementation=implementation)
    model = tiny(kind)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' is not supported"):
        type(model).from_pretrained(tmp_path, attn_implementation=implementation)
    assert type(model).from_pretrained(tmp_path, attn_implementation="eager").config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' is not supported"):
        model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == "sdpa"


# ---- position ids ----------------------------------------------------------------------------
@kinds
def test_default_position_ids_change_nothing(kind):
    model, tokens = tiny(kind), ids()
    expected = logits_of(model, tokens)
    torch.testing.assert_close(logits_of(model, tokens, position_ids=torch.arange(LENGTH)[None]), expected,
                               rtol=0, atol=0)
    # a cached continuation with the positions generate() passes (the count of tokens before)
    cache = MODELS[kind][3](model.config)
    with torch.no_grad():
        first = model(tokens[:, :10], position_ids=torch.arange(10)[None], past_key_values=cache).logits
        rest = model(tokens[:, 10:], position_ids=torch.arange(10, LENGTH)[None].expand(2, -1),
                     past_key_values=cache).logits
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=1e-5, atol=1e-5)


@kinds
def test_generate_with_padding_passes_its_positions(kind):
    """generate() counts positions from the attention mask; a left-padded row decodes as it does alone."""
    model = tiny(kind)
    row = ids(1, 7)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    batch = torch.cat([padded, ids(1, 10, seed=5)])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    alone = model.generate(row, max_new_tokens=4, do_sample=False)
    together = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(together[0, 3:], alone[0])


def test_kvm_honours_position_ids_cached_as_uncached():
    model, tokens = tiny("kvm"), ids()
    gap = torch.cat([torch.arange(12), torch.arange(52, 64)])[None].expand(2, -1)
    plain, moved = logits_of(model, tokens), logits_of(model, tokens, position_ids=gap)
    torch.testing.assert_close(moved[:, :12], plain[:, :12], rtol=0, atol=0)
    assert (moved[:, 12:] - plain[:, 12:]).abs().max() > 1e-3  # rotary reads the gap, as Llama's does
    cache = KVMCache(model.config)
    with torch.no_grad():
        steps = [model(tokens[:, :10], position_ids=gap[:, :10], past_key_values=cache).logits]
        steps += [model(tokens[:, t:t + 1], position_ids=gap[:, t:t + 1], past_key_values=cache).logits
                  for t in range(10, LENGTH)]
    torch.testing.assert_close(torch.cat(steps, dim=1), moved, rtol=1e-4, atol=1e-4)


def test_maglev_refuses_other_position_ids():
    model, tokens = tiny("maglev"), ids()
    for positions in (torch.arange(LENGTH) + 3, torch.cat([torch.arange(12), torch.arange(52, 64)])):
        with pytest.raises(ValueError, match="position_ids differ from Maglev's own positions"):
            model(tokens, position_ids=positions[None])
    cache = MaglevCache(model.config)
    model(tokens[:, :10], past_key_values=cache)
    with pytest.raises(ValueError, match="position_ids differ from Maglev's own positions"):  # a decoding step
        model(tokens[:, 10:11], position_ids=torch.full((2, 1), 12), past_key_values=cache)
    model(tokens[:, 10:11], position_ids=torch.full((2, 1), 10), past_key_values=cache)


@kinds
def test_packed_sequences_run_and_refuse_a_cache(kind):
    """DataCollatorWithFlattening's packed batches run (each document alone, tests/models/packing); a packed
    row with a cache is refused, as are position ids that restart on a used cache or skip."""
    model = tiny(kind)
    batch = DataCollatorWithFlattening()([{"input_ids": ids(1, 10)[0].tolist()},
                                          {"input_ids": ids(1, 14, seed=2)[0].tolist()}])
    assert model(**batch).logits.shape[:2] == (1, 24)
    with pytest.raises(ValueError, match="cannot be run with a cache"):
        model(**batch, use_cache=True)
    model.train()
    assert torch.isfinite(model(**batch).loss)
    model.eval()
    cache = MODELS[kind][3](model.config)
    model(ids(1, 8), past_key_values=cache)
    with pytest.raises(ValueError, match="restart inside a row"):  # a new sequence on a used cache
        model(ids(1, 4), position_ids=torch.arange(4)[None], past_key_values=cache)
    with pytest.raises(ValueError, match="restart inside a row"):  # the same in a one-token step
        model(ids(1, 1), position_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="position_ids must be an integer"):
        model(ids(1, 4), position_ids=torch.arange(5)[None])


# ---- generate ----------------------------------------------------------------------------------
@kinds
@pytest.mark.parametrize("implementation", ["static", "offloaded"])
def test_foreign_cache_implementations_name_the_models_cache(kind, implementation):
    model = tiny(kind)
    name = MODELS[kind][3].__name__
    with pytest.raises(ValueError, match=f"cache_implementation='{implementation}' is not supported.*{name}"):
        model.generate(ids(1, 6), max_new_tokens=2, do_sample=False, cache_implementation=implementation)


# ---- Auto classes ------------------------------------------------------------------------------
# In a fresh process: which model types transformers' Auto classes resolve after importing both models, and after
# registering them (twice: the second call must be harmless).
REGISTRATION = r"""
import json
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
import kvm_maglev
models = {"kvm": (kvm_maglev.KVMConfig, kvm_maglev.KVMForCausalLM),
          "maglev": (kvm_maglev.MaglevConfig, kvm_maglev.MaglevForCausalLM)}
def resolved():
    return sorted(name for name, (config, model) in models.items()
                  if name in CONFIG_MAPPING and CONFIG_MAPPING[name] is config
                  and config in MODEL_FOR_CAUSAL_LM_MAPPING and MODEL_FOR_CAUSAL_LM_MAPPING[config] is model)
seen = [resolved()]
kvm_maglev.register_auto_classes()
kvm_maglev.register_auto_classes()
print(json.dumps(seen + [resolved()]))
"""


def test_importing_registers_nothing_and_register_auto_classes_registers_both():
    result = subprocess.run([sys.executable, "-c", REGISTRATION], capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[], ["kvm", "maglev"]]
