"""A model's card travels through save_pretrained (push_to_hub is covered end to end in test_hub.py)."""

import torch

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.package_only.carried_card import carried_card_text

SOURCE_CARD = "---\nlicense: apache-2.0\ntags:\n- kvm-maglev\n---\n# Tiny model\n\nWhat it is.\n"


def tiny_models():
    yield KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   chunk_size=8))
    yield MaglevForCausalLM(MaglevConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, max_position_embeddings=64))


def test_save_pretrained_carries_the_source_card_without_its_path(tmp_path):
    for index, model in enumerate(tiny_models()):
        source, saved, bare, kept = (tmp_path / f"{name}{index}" for name in ("source", "saved", "bare", "kept"))
        model.save_pretrained(bare)
        assert not (bare / "README.md").exists()  # a model made in memory has no card to carry
        model.save_pretrained(source)
        (source / "README.md").write_text(SOURCE_CARD)
        loaded = type(model).from_pretrained(source)
        loaded.save_pretrained(saved)
        card = (saved / "README.md").read_text()
        assert card.startswith("---\nlicense: apache-2.0") and "What it is." in card
        assert "Saved again from a local copy" in card and str(tmp_path) not in card and "base_model" not in card
        kept.mkdir()
        (kept / "README.md").write_text("mine\n")
        loaded.save_pretrained(kept)
        assert (kept / "README.md").read_text() == "mine\n"  # a card already in the folder is never replaced
        with torch.no_grad():
            assert torch.equal(type(model).from_pretrained(saved).lm_head.weight, model.lm_head.weight)


def test_a_hub_source_becomes_the_base_model_once():
    first = carried_card_text(SOURCE_CARD, "org/base", extra_tags=["pushed"])
    assert "base_model: org/base" in first and "- pushed" in first and "- kvm-maglev" in first
    again = carried_card_text(first, "user/tuned")
    assert "base_model: user/tuned" in again and "org/base" not in again
    assert again.count("Saved again from") == 1 and "\n\n\n" not in again
