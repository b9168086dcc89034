"""resize_token_embeddings on both models (adding chat tokens, trimming a vocabulary): every table indexed by
token id gets exactly the rows asked for (transformers' contract: padded only to a `pad_to_multiple_of` the caller
gives, Maglev's `pad_vocab_size_to` padding dropped), new ids start where transformers starts them, old ids keep
their logits, tied heads stay tied, and save_pretrained -> from_pretrained round-trips."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from tests.generation.testers import KVM_BASE
from tests.models.maglev.test_maglev_model import VOCAB as MAGLEV_VOCAB
from tests.models.maglev.test_maglev_model import tiny_model as maglev_model

MODELS = {
    "kvm": dict(),
    "kvm_tied": dict(tie_word_embeddings=True),
    "maglev": dict(),  # pad_vocab_size_to 64: 97 ids in 128 rows
    "maglev_unpadded": dict(pad_vocab_size_to=1),
    "maglev_tied": dict(tie_word_embeddings=True),
}
# (added ids, pad_to_multiple_of): across the padding, within it, fewer ids, rounded up to a multiple
RESIZES = {"grow_past_padding": (40, None), "grow_within_padding": (3, None), "shrink": (-20, None),
           "pad_to_multiple_of": (4, 8)}


def build(name: str):
    overrides = MODELS[name]
    if name.startswith("maglev"):
        return maglev_model(**overrides)
    torch.manual_seed(0)
    model = KVMForCausalLM(KVMConfig(**{**KVM_BASE, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model


def token_tables(model) -> dict[str, torch.Tensor]:
    """Every weight whose rows are token ids."""
    tables = {"embed_tokens": model.get_input_embeddings().weight, "lm_head": model.get_output_embeddings().weight}
    for key, table in getattr(model.model, "value_embeddings", {}).items():
        tables[f"value_embeddings.{key}"] = table.weight
    return tables


@torch.no_grad()
@pytest.mark.parametrize("resize", RESIZES)
@pytest.mark.parametrize("name", MODELS)
def test_resize_round_trips_and_keeps_old_ids(tmp_path, name, resize):
    model = build(name)
    old_vocab = model.config.vocab_size
    added, multiple = RESIZES[resize]
    vocab = old_vocab + added if multiple is None else math.ceil((old_vocab + added) / multiple) * multiple
    kept = min(old_vocab, vocab)
    ids = torch.randint(0, kept, (2, 20), generator=torch.Generator().manual_seed(5))
    before = model(ids).logits
    old_tables = {key: table.clone() for key, table in token_tables(model).items()}

    model.resize_token_embeddings(old_vocab + added, pad_to_multiple_of=multiple)

    assert model.config.vocab_size == vocab
    assert getattr(model.config, "pad_vocab_size_to", 1) == 1  # the rows are what was asked for
    for key, table in token_tables(model).items():
        assert table.shape[0] == vocab, key
        assert torch.equal(table[:kept], old_tables[key][:kept]), key
    tied = model.config.tie_word_embeddings
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    after = model(ids).logits
    assert after.shape[-1] == vocab
    assert torch.allclose(after[..., :kept], before[..., :kept], atol=1e-5)
    # the new ids are real tokens: they can be read, and are predicted from their own rows
    with_new = torch.cat([ids, torch.full((2, 1), vocab - 1)], dim=1)
    logits = model(with_new).logits

    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert loaded.config.vocab_size == vocab
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tied
    for key, table in token_tables(loaded).items():
        assert torch.equal(table, token_tables(model)[key]), key
    # same weights; a reloaded model's hidden states can differ by float rounding (7e-7 seen), times the head
    assert torch.allclose(loaded(with_new).logits, logits, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("name", ["kvm", "maglev", "maglev_unpadded"])
def test_added_rows_start_at_the_mean_of_the_real_rows(name):
    """transformers' mean resizing: added ids sit (to 1e-9 covariance) at the mean of the old real rows - never
    on Maglev's old padding rows, which no token ever trained."""
    model = build(name)
    old_vocab = model.config.vocab_size
    old_tables = {key: table.clone() for key, table in token_tables(model).items()}
    model.resize_token_embeddings(old_vocab + 5)
    resized = {key: table.clone() for key, table in token_tables(model).items()}
    model.post_init()  # as transformers' own resize, the new tables count as initialised
    assert all(torch.equal(table, resized[key]) for key, table in token_tables(model).items())
    for key, table in token_tables(model).items():
        if model.config.tie_word_embeddings and key == "lm_head":
            continue
        mean = old_tables[key][:old_vocab].float().mean(dim=0)
        added = table[old_vocab:old_vocab + 5].float()
        assert torch.allclose(added, mean.expand_as(added), atol=1e-3), key
        if old_tables[key].shape[0] > old_vocab:  # Maglev: the ids that used to be padding
            assert not torch.allclose(added, old_tables[key][old_vocab:old_vocab + 5].float(), atol=1e-3), key


@torch.no_grad()
def test_without_mean_resizing_added_rows_take_the_tables_own_init():
    model = build("maglev")
    old_vocab = model.config.vocab_size
    model.resize_token_embeddings(old_vocab + 40, mean_resizing=False)
    bound = (3.0 / model.config.hidden_size) ** 0.5  # value embeddings: nanochat's uniform bound
    for key, table in token_tables(model).items():
        added = table[old_vocab:]
        if key.startswith("value_embeddings"):
            assert added.abs().max() <= bound and added.std() > bound / 4, key
        elif key == "lm_head":  # nanochat's head: normal, std 0.001
            assert 0.0005 < added.std() < 0.002, key
        else:  # embeddings: normal, std 1
            assert 0.8 < added.std() < 1.2, key


def test_resize_refuses_a_bad_size():
    model = build("maglev")
    with pytest.raises(ValueError, match="new_num_tokens"):
        model.resize_token_embeddings(0)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        model.resize_token_embeddings(100, pad_to_multiple_of=0)
    assert model.config.vocab_size == MAGLEV_VOCAB


@torch.no_grad()
@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), new_num_tokens=st.integers(1, 200),
       multiple=st.one_of(st.none(), st.integers(1, 70)))
def test_resize_gives_the_rows_asked_for(name, new_num_tokens, multiple):
    """transformers' contract over sizes: `new_num_tokens` rows (rounded up to `pad_to_multiple_of`), as many
    ids and logits, and the kept ids' logits unchanged - from a padded Maglev table too."""
    model = build(name)
    old_vocab = model.config.vocab_size
    rows = new_num_tokens if multiple is None else math.ceil(new_num_tokens / multiple) * multiple
    kept = min(old_vocab, rows)
    ids = torch.randint(0, kept, (2, 12), generator=torch.Generator().manual_seed(3))
    before = model(ids).logits
    returned = model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of=multiple)
    assert returned is model.get_input_embeddings() and model.config.vocab_size == rows
    assert {key: table.shape[0] for key, table in token_tables(model).items()} == dict.fromkeys(token_tables(model), rows)
    after = model(ids).logits
    assert after.shape[-1] == rows
    assert torch.allclose(after[..., :kept], before[..., :kept], atol=1e-5)


@torch.no_grad()
def test_padding_to_a_multiple_keeps_a_padded_layout_and_refuses_a_non_integer():
    """A Maglev resized to its own vocabulary loses nanochat's padding rows; `pad_to_multiple_of` (what
    transformers offers for tensor-core friendly tables) pads again, and a non-integer multiple is refused in
    transformers' own words."""
    model = build("maglev")
    assert model.get_input_embeddings().weight.shape[0] == 128  # 97 ids in nanochat's rows padded to 64
    model.resize_token_embeddings(MAGLEV_VOCAB)
    assert model.get_input_embeddings().weight.shape[0] == MAGLEV_VOCAB
    model.resize_token_embeddings(MAGLEV_VOCAB, pad_to_multiple_of=64)
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == 128
    with pytest.raises(ValueError, match="multiple of `1.3`, which is not and integer"):
        model.resize_token_embeddings(MAGLEV_VOCAB, pad_to_multiple_of=1.3)
