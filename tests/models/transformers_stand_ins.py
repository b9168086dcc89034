"""Our stand-ins for the two test modules transformers' source distribution lacks and its
`test_modeling_common.py` imports: `tests/generation/test_utils.py` (GenerationTesterMixin) and
`tests/exporters/test_export.py` (ExportTesterMixin). Both answer under either import path."""

from __future__ import annotations

import torch


class ExportTesterMixin:
    """Stand-in with no tests: the torch.export checks live in a module the distribution does not ship,
    and this suite does not export the models."""


class GenerationTesterMixin:
    """Stand-in for transformers' generation tests, reduced to what a compressed-state model must keep: greedy
    generate() picks the argmax of the uncached forward at every step, and the cache it returns is checked
    by `_check_past_key_values_for_generate`, the hook a test class overrides for caches that are not
    per-layer key/value lists."""

    max_new_tokens = 4

    def _check_past_key_values_for_generate(self, batch_size: int, cache, seq_length: int, config) -> None:
        raise NotImplementedError("the test class checks its own cache")

    @torch.no_grad()
    def test_greedy_generate_matches_uncached_forward(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = model_class(config).eval()
            prompt = inputs["input_ids"]
            out = model.generate(prompt, attention_mask=inputs.get("attention_mask"), do_sample=False,
                                 max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens,
                                 return_dict_in_generate=True, pad_token_id=0)
            sequences = out.sequences
            logits = model(sequences[:, :-1], use_cache=False).logits
            expected = logits[:, prompt.shape[1] - 1:].argmax(-1)
            self.assertTrue(torch.equal(expected, sequences[:, prompt.shape[1]:]),
                            "greedy generate() differs from the argmax of the uncached forward")
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            self._check_past_key_values_for_generate(prompt.shape[0], cache, sequences.shape[1] - 1, config)
