"""The language-modelling example's ladder pieces: the cast header, the oracle-fed arm, the teacher schedule's
self-feeding switch, the switch to recurrent training, the recipes with their own consistency weight, and the
cast-membership probe."""

import random
from types import SimpleNamespace

import pytest
import torch

from kvm_maglev.corpora import cast_header, cast_story, name_pool, pack_bytes
from kvm_maglev.training import MAGLEV_RECIPE, MAGLEV_RECIPES
from tests.ecosystem.ecosystem_support import load_example

train_lm = load_example("train_lm")


def _stories(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [cast_story(rng, train_lm.CAST_POOL, 3, 10).encode("ascii") for _ in range(count)]


def test_cast_header_reads_the_cast_and_where_the_header_ends():
    story = cast_story(random.Random(3), name_pool(20, seed=1), 3, 4).encode("ascii")
    names, end = cast_header(story)
    assert story.startswith(f"Cast: {', '.join(names)}.".encode()) and story[end:end + 1] == b"."
    assert len(set(names)) == 3
    with pytest.raises(ValueError, match="not the opening of a cast story"):
        cast_header(b"Once upon a time.")


def test_a_preamble_moves_the_header_and_cast_header_still_reads_it():
    story = cast_story(random.Random(4), name_pool(20, seed=1), 3, 4, preamble_bytes=80).encode("ascii")
    names, end = cast_header(story)
    start = story.index(b"Cast: ")
    assert story[start:end + 1] == f"Cast: {', '.join(names)}.".encode() and start <= 80
    assert cast_story(random.Random(4), name_pool(20, seed=1), 3, 4) == cast_story(
        random.Random(4), name_pool(20, seed=1), 3, 4, preamble_bytes=0)


def test_cast_labels_match_each_rows_story():
    stories = _stories(4, seed=5)
    rows = pack_bytes(stories, train_lm.SEQ_LEN, train_lm.BOS, rows_per_document=1)
    labels = train_lm.cast_labels(rows)
    for row, story, cast, end in zip(rows, stories, labels["cast"].tolist(), labels["header_end"].tolist()):
        names, header_end = cast_header(story)
        assert [train_lm.CAST_POOL[i] for i in cast] == names
        assert end == header_end + 1 and row[end].item() == ord(".")  # row position 0 is BOS


def test_recipes_may_name_their_own_consistency_weight():
    assert train_lm.ARMS["maglev_paper_w0"](10).config.consistency_weight == 0.0
    assert train_lm.ARMS["maglev_paper_w1"](10).config.consistency_weight == 1.0
    assert train_lm.ARMS["maglev_paper"](10).config.consistency_weight == 0.1
    no_coupling = train_lm.ARMS["maglev_self_feed2_w0"](10).config
    assert (no_coupling.consistency_weight, no_coupling.memory_self_feed_steps) == (0.0, 2)
    assert MAGLEV_RECIPES["paper_w0"] == {"consistency_weight": 0.0}


def test_maglev_arm_is_the_shipped_recipe():
    shipped = train_lm.ARMS["maglev"](10).config.to_dict()
    named = train_lm.ARMS[f"maglev_{MAGLEV_RECIPE}"](10).config.to_dict()
    assert shipped == named


def test_oracle_fed_memory_is_unread_until_the_header_closes_then_the_cast_code():
    model = train_lm.ARMS["oracle_fed"](10)
    torch.nn.init.normal_(model.unread)
    cast, header_end = torch.tensor([[0, 1, 2], [5, 6, 7]]), torch.tensor([3, 5])
    mu = model.memory_inputs(cast, header_end, 9)
    assert torch.equal(mu[0, :4], model.unread.expand(4, -1)) and torch.equal(mu[1, :6], model.unread.expand(6, -1))
    assert torch.allclose(mu[0, 4:].square().mean(-1), torch.ones(5), atol=1e-4)  # rms-normed like a memory
    assert torch.equal(mu[0, 4], mu[0, 8]) and not torch.allclose(mu[0, 8], mu[1, 8])
    ids = torch.randint(0, 256, (2, 9))
    loss = model(input_ids=ids, cast=cast, header_end=header_end, labels=ids).loss
    loss.backward()
    assert model.cast_embedding.weight.grad[:3].abs().sum() > 0 and model.cast_embedding.weight.grad[3].abs().sum() == 0


def test_teacher_arm_self_feeds_from_half_way_with_the_frozen_prefiller():
    steps = 10
    model = train_lm.ARMS["maglev_teacher_w1"](steps)
    config = model.config
    assert (config.consistency_weight, config.consistency_detach_target_after) == (0.0, 5)
    assert config.consistency_weight_after_detach == 1.0 and config.memory_projection
    switch = [c for c in train_lm.arm_callbacks("maglev_teacher_w1", model, steps) if isinstance(c, train_lm.SelfFeedFrom)]
    assert len(switch) == 1
    for step, passes in ((0, 0), (4, 0), (5, 2), (9, 2)):
        switch[0].on_step_begin(None, SimpleNamespace(global_step=step), None, model=model)
        assert config.memory_self_feed_steps == passes
    assert not any(isinstance(c, train_lm.SelfFeedFrom) for c in train_lm.arm_callbacks("maglev_paper", model, steps))


def test_switch_arm_trains_lifted_then_on_ps_own_rollouts():
    steps = 8
    model = train_lm.ARMS["maglev_w0_then_recurrent_late"](steps)
    switch = [c for c in train_lm.arm_callbacks("maglev_w0_then_recurrent_late", model, steps)
              if isinstance(c, train_lm.RecurrentFrom)]
    assert len(switch) == 1 and model.config.consistency_weight == 0.0
    for step, forward in ((0, "lifted"), (5, "lifted"), (6, "recurrent"), (7, "recurrent")):
        switch[0].on_step_begin(None, SimpleNamespace(global_step=step), None, model=model)
        assert model.config.training_forward == forward
    # after the switch a training step's loss is the inference forward's, and only P learns (Q is not run)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 40))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, use_cache=False).logits[:, :-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads["model.memory_init"] is not None and grads["model.memory_init"].abs().sum() > 0
    prefiller = [g for name, g in grads.items() if "prefiller" in name]
    assert prefiller and all(g is None for g in prefiller)
    assert not train_lm.arm_callbacks("maglev_self_feed2_w0", model, steps)[1:]


def test_shipped_recipe_then_recurrent_keeps_the_recipe_until_its_switch():
    steps = 8
    model = train_lm.ARMS["maglev_self_feed2_then_recurrent_late"](steps)
    assert model.config.memory_self_feed_steps == 2 and model.config.consistency_weight == 0.1
    (switch,) = [c for c in train_lm.arm_callbacks("maglev_self_feed2_then_recurrent_late", model, steps)
                 if isinstance(c, train_lm.RecurrentFrom)]
    assert switch.step == 6


def test_recurrent_arm_has_no_prefiller_and_is_scored_on_its_own_memory():
    model = train_lm.ARMS["maglev_recurrent"](4)
    assert not model.config.has_prefiller and model.config.training_forward == "recurrent"
    assert train_lm.eval_modes(model) == {"recurrent": "recurrent"}
    assert set(train_lm.eval_modes(train_lm.ARMS["maglev_self_feed2"](4))) == {"recurrent", "prefiller"}


def test_cast_probe_reads_a_cast_code_and_not_noise():
    rows = pack_bytes(_stories(500, seed=7), train_lm.SEQ_LEN, train_lm.BOS, rows_per_document=1)
    labels = train_lm.cast_labels(rows)
    codes = torch.randn(len(train_lm.CAST_POOL), 64, generator=torch.Generator().manual_seed(0))
    coded = codes[labels["cast"]].sum(dim=1)[:, None, :].expand(-1, train_lm.SEQ_LEN, -1)
    fit, held = slice(0, 400), slice(400, 500)

    def probe(features):
        return train_lm.cast_probe(features[fit], {k: v[fit] for k, v in labels.items()},
                                   features[held], {k: v[held] for k, v in labels.items()})

    assert min(probe(coded).values()) > 0.8  # a linear read of three 64-wide codes out of 200: about 0.88
    assert max(probe(torch.randn(500, train_lm.SEQ_LEN, 64)).values()) < 0.1


def test_ladder_rows_compare_past_window_bpb_with_the_sliding_window():
    results = {"swa_baseline": {"recurrent": {"all": 0.7, "first_window": 0.9, "past_window": 0.5}},
               "oracle_fed": {"oracle": {"all": 0.6, "first_window": 0.9, "past_window": 0.4}}}
    rows = {row["arm"]: row for row in train_lm.ladder_rows(results)}
    assert rows["oracle_fed"]["past_vs_sliding_window"] == pytest.approx(-0.2)
    assert rows["swa_baseline"]["past_vs_sliding_window"] == 0.0


def test_kvm_backbone_full_attends_the_whole_row_and_reads_no_state():
    """Its window covers a training row, so its logits are those of the same weights with an even wider window
    (no state read either way), and differ from the same weights under kvm_fixed's 32-byte window."""
    torch.manual_seed(0)
    full = train_lm.ARMS["kvm_backbone_full"](10).eval()
    with torch.no_grad():  # output projections start at zero, which would hide attention altogether
        for parameter in full.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    wider = train_lm._kvm(window_chunks=2 * train_lm.SEQ_LEN // 16).eval()
    windowed = train_lm.ARMS["kvm_fixed"](10).eval()
    wider.load_state_dict(full.state_dict())
    windowed.load_state_dict(full.state_dict())
    row = torch.randint(0, 256, (2, train_lm.SEQ_LEN))
    with torch.no_grad():
        logits = full(row, use_cache=False).logits
        assert torch.allclose(logits, wider(row, use_cache=False).logits, atol=1e-5)
        assert not torch.allclose(logits[:, 64:], windowed(row, use_cache=False).logits[:, 64:], atol=1e-3)


def test_kvm_backbone_swa_sees_only_its_window_and_keeps_kvms_init():
    """Every layer is the sliding-window mixer (no KVM attention, so no state), initialised as KVM initialises
    it; a byte changes no logit further on than two windows plus the token shifts."""
    from kvm_maglev.models.kvm.modeling_kvm import KVMAttention, KVMSlidingWindowAttention

    torch.manual_seed(0)
    model = train_lm.ARMS["kvm_backbone_swa"](10).eval()
    kvm = train_lm.ARMS["kvm_fixed"](10)
    assert not any(isinstance(m, KVMAttention) for m in model.modules())
    for layer, reference in zip(model.model.layers, kvm.model.layers):
        assert isinstance(layer.self_attn, KVMSlidingWindowAttention)
        assert torch.equal(layer.self_attn.k_shift, reference.self_attn.k_shift)
        assert torch.equal(layer.self_attn.o_proj.weight, torch.zeros_like(layer.self_attn.o_proj.weight))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
        row = torch.randint(0, 256, (1, train_lm.SEQ_LEN))
        changed = row.clone()
        changed[0, 0] = (row[0, 0] + 1) % 256
        difference = (model(row).logits - model(changed).logits).abs().amax(dim=-1)[0]
    reach = 2 * (train_lm.WINDOW + 2)
    assert difference[:8].min() > 1e-4 and difference[reach:].max() == 0


def test_header_offset_moves_the_cast_header_into_the_row():
    train, validation = train_lm.corpus_rows("cast", seed=0, header_offset=96)
    labels = train_lm.cast_labels(train[:200])
    ends = labels["header_end"]
    assert ends.max() > 60 and ends.min() < 40  # the header now ends anywhere from the start to ~100 bytes in
    assert all(row[end].item() == ord(".") for row, end in zip(train[:200], ends.tolist()))
    plain, _ = train_lm.corpus_rows("cast", seed=0)
    assert bytes(plain[0, 1:7].tolist()) == b"Cast: "
    with pytest.raises(ValueError, match="header-offset"):
        train_lm.corpus_rows("stdlib", seed=0, header_offset=8)


def test_cast_rows_grow_with_the_run_and_keep_the_shorter_runs_rows():
    """A run longer than the default corpus gets fresh stories rather than a second epoch; shorter runs keep
    exactly the rows they had (the story stream is seeded), so earlier results stay reproducible."""
    default, validation = train_lm.corpus_rows("cast", seed=0)
    wanted = default.shape[0] + 3000
    longer, longer_validation = train_lm.corpus_rows("cast", seed=0, min_rows=wanted)
    assert longer.shape[0] >= wanted
    assert torch.equal(longer[: default.shape[0]], default) and torch.equal(longer_validation, validation)
    same, _ = train_lm.corpus_rows("cast", seed=0, min_rows=2400 * 16)
    assert torch.equal(same, default)
