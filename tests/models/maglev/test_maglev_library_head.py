"""What libraries that read the model's parts see (TRL's fused log-prob head reads the base model's output, the
output embeddings' weight and `final_logit_softcapping`): a head of exactly vocab_size rows, padded saves that
still load (and come back unpadded), and `training_forward="recurrent"`, with which training-mode forwards score
the distribution generate() samples from."""

import json

import pytest
import torch

from kvm_maglev.models.maglev import MaglevForCausalLM
from tests.models.maglev.test_maglev_model import VOCAB, random_ids, tiny_model


def head_log_probs(model, ids):
    """What a library computes from the parts: base model output, output embeddings' weight, the softcap."""
    hidden = model.model(input_ids=ids).last_hidden_state
    logits = hidden @ model.get_output_embeddings().weight.T
    cap = model.config.final_logit_softcapping
    return torch.log_softmax(cap * torch.tanh(logits / cap), dim=-1)


def test_head_has_vocab_rows_and_its_parts_give_the_models_log_probs():
    model = tiny_model()  # 97 ids, embeddings padded to 128 rows
    assert model.get_input_embeddings().weight.shape[0] == 128
    assert model.get_output_embeddings().weight.shape[0] == VOCAB and not model.config.lm_head_padded
    ids = random_ids(2, 12)
    with torch.no_grad():
        own = torch.log_softmax(model(ids).logits, dim=-1)
        assert torch.allclose(head_log_probs(model, ids), own, atol=1e-5)


def test_a_padded_save_loads_and_comes_back_unpadded(tmp_path):
    model = tiny_model(lm_head_padded=True)
    assert model.lm_head.weight.shape[0] == 128
    ids = random_ids(2, 12)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["lm_head_padded"]  # as saved before the field existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = MaglevForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.shape[0] == VOCAB and loaded.config.lm_head_padded is False
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight[:VOCAB])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, before, atol=1e-6)
    loaded.save_pretrained(tmp_path / "again")  # and saves as a new config, unpadded
    assert MaglevForCausalLM.from_pretrained(tmp_path / "again").lm_head.weight.shape[0] == VOCAB


def test_tied_embeddings_share_one_unpadded_table():
    model = tiny_model(tie_word_embeddings=True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert model.lm_head.weight.shape[0] == VOCAB


def test_recurrent_training_forward_scores_what_inference_scores_and_trains():
    ids = random_ids(2, 20)  # longer than the window (8): the memory carries information
    lifted = tiny_model(has_prefiller=True, prefiller_shares_blocks=False)
    recurrent = tiny_model(has_prefiller=True, prefiller_shares_blocks=False, training_forward="recurrent")
    with torch.no_grad():
        inference = recurrent.eval()(ids).logits
        assert torch.equal(inference, lifted.eval()(ids).logits)  # same weights, same inference
    recurrent.train()
    output = recurrent(ids, labels=ids)
    assert torch.allclose(output.logits, inference, atol=1e-5)
    assert output.consistency_loss is None  # Q does not run
    output.loss.backward()
    assert recurrent.model.memory_init.grad is not None and recurrent.model.memory_init.grad.abs().sum() > 0
    with torch.no_grad():
        lifted_logits = lifted.train()(ids).logits
    assert (lifted_logits - inference).abs().max() > 1e-3  # the lifted pass is another distribution


def test_training_forward_is_checked():
    with pytest.raises(ValueError, match="training_forward"):
        tiny_model(training_forward="parallel")
