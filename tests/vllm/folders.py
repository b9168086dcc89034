"""Tiny random-weight converted folders (config, safetensors, tokenizer) for the vLLM tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models.maglev.test_maglev_model import randomize

VOCAB = 97


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer of `vocab` ids: vLLM's server needs one in the folder to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{vocab - 1}",
                                   bos_token="w1")


def make_maglev_folder(folder: Path, seed: int = 0, **overrides) -> Path:
    """A converted-style Maglev folder: window 8, 3 layers, GQA, every nanochat feature on, random weights."""
    from kvm_maglev import MaglevConfig, MaglevForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, window_pattern="SL", sliding_window=8,
                  prefiller_window_pattern="SL", memory_gate_channels=12, has_prefiller=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = randomize(MaglevForCausalLM(MaglevConfig(**fields)), seed).eval()
    model.save_pretrained(folder)
    tiny_tokenizer(fields["vocab_size"]).save_pretrained(folder)
    return folder


def make_kvm_folder(folder: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """A KVM folder of one of the KVM cache tests' variants (chunk 4, window 2 chunks, every switch exercised
    there), random weights."""
    from tests.models.kvm.test_kvm_cache import VARIANTS, random_model

    model = random_model(seed, vocab_size=VOCAB, **{**VARIANTS[variant], **overrides})
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder
