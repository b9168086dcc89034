"""transformers' own `ModelTesterMixin` (test_modeling_common.py of the installed release's source distribution,
fetched from the package index at test time; the module skips when it cannot be) against tiny KVM and Maglev
models. The sequences reach past KVM's window so the state is merged into and read, Maglev runs with its
memory on, and weights the default init zeroes (output projections, gates, smear, memory_init) are drawn
random so that no block is a no-op. Mixin tests that cannot apply are skipped with the reason."""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
from transformers import initialization as init
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.kvm.cache_kvm import KVMCache
from kvm_maglev.models.kvm.modeling_kvm import KVMPreTrainedModel
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM, MaglevPreTrainedModel

from .transformers_common_tests import SdistUnavailable, load_test_modeling_common
from .transformers_stand_ins import GenerationTesterMixin

parameterized = pytest.importorskip(
    "parameterized", reason="transformers' common tests need `parameterized` (pip install -e .[test])").parameterized
try:
    common = load_test_modeling_common()
except SdistUnavailable as error:
    pytest.skip(f"transformers' test_modeling_common.py is not available: {error}", allow_module_level=True)


def perturbed_init(original):
    """`_init_weights` that then draws random values for the parameters the default init left all zero
    (weights a checkpoint loaded are left alone, as transformers' init functions do)."""

    def _init_weights(self, module: torch.nn.Module) -> None:
        original(self, module)
        for param in module.parameters(recurse=False):
            if param.device.type != "meta" and not torch.any(param):
                std = 0.5 * param.shape[-1] ** -0.5 if param.ndim == 2 else 0.2
                init.normal_(param, std=std)

    return _init_weights


class TinyModelTester:
    """The ModelTester the mixin reads: sizes, config and inputs (random ids, all-ones mask)."""

    batch_size = 2
    seq_length = 20
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 2
    is_training = True

    def __init__(self, config_class: type, fields: dict):
        self.config_class = config_class
        self.fields = fields

    def get_config(self):
        return self.config_class(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                 num_hidden_layers=self.num_hidden_layers,
                                 num_attention_heads=self.num_attention_heads, **self.fields)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.ones_like(input_ids)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


ATTENTION_WEIGHTS_REFUSED = ("output_attentions=True is refused (README feature table): a query's softmax spans "
                             "a compressed state (KVM's merged slots, Maglev's memory-injected keys) beside a window, "
                             "which no [batch, heads, query, key] tensor over the tokens describes")

class CompressedStateModelTest(common.ModelTesterMixin, GenerationTesterMixin):
    """What both models share: the perturbed init, the causal-LM registration the mixin looks classes up in,
    and the skips."""

    pretrained_class: type
    config_class: type
    config_fields: dict
    test_can_init_all_missing_weights_before_2023 = True  # our files carry no copyright year; run it anyway

    def setUp(self):
        self.model_tester = TinyModelTester(self.config_class, self.config_fields)
        patchers = (
            mock.patch.object(self.pretrained_class, "_init_weights",
                              perturbed_init(self.pretrained_class._init_weights)),
            # the mixin gives labels to, and runs the loss tests on, the classes in this table, as
            # AutoModelForCausalLM.register does for the auto classes
            mock.patch.dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                            {self.config_class.model_type: self.all_model_classes[0].__name__}),
        )
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_no_parameter_is_all_zero(self):
        """The models the mixin builds have no all-zero weight: the default init zeroes output projections and
        gates, with which a block (or the memory) would pass every comparison unseen."""
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        model = self.all_model_classes[0](config)
        self.assertEqual([name for name, param in model.named_parameters() if not torch.any(param)], [])

    def without_attention_weights(self, test) -> None:
        """Run a mixin test that checks hidden states and attention weights with the weights left out."""
        with mock.patch.object(type(self), "has_attentions", False):
            test()

    def test_model_outputs_equivalence(self):
        self.without_attention_weights(super().test_model_outputs_equivalence)

    def test_retain_grad_hidden_states_attentions(self):
        self.without_attention_weights(super().test_retain_grad_hidden_states_attentions)

    def test_attention_outputs(self):
        self.skipTest(ATTENTION_WEIGHTS_REFUSED)

    @parameterized.expand(common.TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION)
    def test_eager_matches_sdpa_inference(self, name, dtype, padding_side, use_attention_mask, output_attentions,
                                          enable_kernels):
        if output_attentions:
            self.skipTest(ATTENTION_WEIGHTS_REFUSED)
        common._test_eager_matches_sdpa_inference(self, name, dtype, padding_side, use_attention_mask,
                                                  output_attentions, enable_kernels)

class KVMModelTest(CompressedStateModelTest, unittest.TestCase):
    all_model_classes = (KVMForCausalLM,)
    pretrained_class = KVMPreTrainedModel
    config_class = KVMConfig
    # window 2 chunks of 4: block 1 is merged into the state at token 12, and tokens 12..19 read it
    config_fields = dict(rotary_dim=8, chunk_size=4, window_chunks=2, state_budget_min=4)

    def _check_past_key_values_for_generate(self, batch_size, cache, seq_length, config):
        self.assertIsInstance(cache, KVMCache)
        self.assertEqual((cache.batch_size, cache.get_seq_length()), (batch_size, seq_length))
        states = [length for row in cache.row_state_lengths() for length in row]
        self.assertTrue(all(length > 0 for length in states), f"the KVM state was not used: {states}")


class MaglevModelTest(CompressedStateModelTest, unittest.TestCase):
    all_model_classes = (MaglevForCausalLM,)
    pretrained_class = MaglevPreTrainedModel
    config_class = MaglevConfig
    # windows of 8 in both layers: tokens 8..19 reach the start of the sequence only through the memory, which
    # a prefiller with blocks of its own writes; tables padded as nanochat's (99 ids in 128 rows)
    config_fields = dict(num_key_value_heads=1, max_position_embeddings=64, sliding_window=8, use_memory=True,
                         has_prefiller=True, prefiller_shares_blocks=False, prefiller_window_pattern="SL",
                         memory_gate_channels=8)

    def _check_past_key_values_for_generate(self, batch_size, cache, seq_length, config):
        self.assertIsInstance(cache, MaglevCache)
        self.assertEqual(cache.get_seq_length(), seq_length)
        self.assertEqual(tuple(cache.last_memory.shape), (batch_size, 1, config.hidden_size))
        self.assertTrue(bool(torch.any(cache.last_memory)), "the Maglev memory was not used")

    def test_inputs_embeds(self):
        self.skipTest("Maglev refuses inputs_embeds with a clear error: its value embeddings and smear read token ids")
