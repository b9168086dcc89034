"""TRL 1.16 as a client of both models: SFTTrainer (padding-free packing and padded batches), DPOTrainer and
GRPOTrainer with the model's own generate(). The numbers TRL computes - the first step's loss, the chosen and
rejected log-probs, the per-token log-probs of sampled completions and the importance ratios - equal the models'
own, computed by plain forwards (float32).

Every TRL trainer here patches the model with TRL's fused log-prob head (`trl.trainer.utils.add_fused_lm_head`):
it runs the base model, then multiplies its last hidden state by `get_output_embeddings().weight` itself, soft-caps
with `config.final_logit_softcapping`, and normalises over every row of that weight. So these tests also pin down
that the softcap is readable under that name and that no padded vocabulary row of the head gets probability mass.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.tokenization.nanochat import load_nanochat_tokenizer, nanochat_generation_token_fields
from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

KINDS = ("kvm", "maglev")
ATOL = 1e-5


# ----- tiny models and their tokenizers -------------------------------------------------------------------------
def tokenizer_for(kind: str):
    """The KVM fixture's small BPE tokenizer (500 ids), or the nanochat test tokenizer (with a chat template)."""
    if kind == "kvm":
        folder = support.REPO_ROOT / "tests" / "data" / "kvm" / "kvm_saturate_swa" / "research_final"
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>",
                                            pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    else:
        tokenizer = load_nanochat_tokenizer(support.REPO_ROOT / "tests" / "data" / "nanochat" / "tiny_sl" / "tokenizer")
    tokenizer.padding_side = "left"  # TRL's prompts; its collators pad completions on the right themselves
    return tokenizer


def tiny_model(kind: str, tokenizer, seed: int = 0, **overrides):
    """A random float32 model in training mode, every parameter moved off its init.

    KVM: chunks of 4 tokens, a two-chunk window, the power-law state (documents of 50+ tokens merge into it).
    Maglev: memory on, a separate prefiller Q (lifted training), vocabulary rows padded to 64 (360 ids in 384)."""
    torch.manual_seed(seed)
    if kind == "kvm":
        config = KVMConfig(**{**dict(
            vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=4,
            window_chunks=2, state_budget_mode="power_law", state_budget_factor=2.0, state_budget_min=4,
            state_max_chunks=100, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id), **overrides})
        model = KVMForCausalLM(config)
    else:
        fields = nanochat_generation_token_fields(tokenizer)
        config = MaglevConfig(**{**dict(
            vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, window_pattern="SL", sliding_window=8,
            has_prefiller=True, prefiller_shares_blocks=False, prefiller_window_pattern="SL",
            consistency_weight=0.5, **fields), **overrides})
        model = MaglevForCausalLM(config)
        model.generation_config.update(**fields)
    support.perturb_(model, seed, scale=0.1)
    return model.train()


def documents(count: int, offset: int = 0) -> list[str]:
    return support.corpus_lines()[offset:offset + count]


def common_args(tmp_path, **overrides) -> dict:
    settings = dict(output_dir=str(tmp_path), max_steps=3, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, use_cpu=True, bf16=False, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    return settings


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) under each row of logits (over the last dimension)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def plain_forward(model):
    """The model's own forward, also under TRL's patch (which only changes a call that passes `fused_lm_head=True`)."""
    if "forward" in vars(model):  # patched by TRL
        return lambda **kwargs: model(**kwargs, fused_lm_head=False)
    return lambda **kwargs: model(**kwargs)


class Recorder:
    """Wraps a callable; keeps each call's keyword arguments and result."""

    def __init__(self, function, transform=None):
        self.function, self.transform, self.calls = function, transform, []

    def __call__(self, *args, **kwargs):
        result = self.function(*args, **kwargs)
        self.calls.append((args, kwargs, result, torch.is_grad_enabled()))
        return result if self.transform is None else self.transform(result)


class CallList(list):
    handle = None


def record_calls(model) -> CallList:
    """Every call of the model (TRL's patched forward included): (args, kwargs, output, grad enabled)."""
    calls = CallList()

    def hook(module, args, kwargs, output):
        calls.append((args, dict(kwargs), output, torch.is_grad_enabled()))

    calls.handle = model.register_forward_hook(hook, with_kwargs=True)
    return calls


# ----- SFT ------------------------------------------------------------------------------------------------------
def document_rows(inputs: dict) -> list[torch.Tensor]:
    """The documents of a batch: split at position_ids restarts (padding-free packing) or cut from padded rows."""
    if "position_ids" in inputs and inputs["input_ids"].shape[0] == 1 and "attention_mask" not in inputs:
        ids, positions = inputs["input_ids"][0], inputs["position_ids"][0]
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        return [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]
    return [row[mask.bool()] for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]


def per_document_loss(model, docs: list[torch.Tensor]) -> float:
    """Mean next-token loss over all documents' tokens, each document run alone through the plain forward."""
    forward = plain_forward(model)
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            logits = forward(input_ids=doc[None]).logits[0, :-1]
            total += -token_log_probs(logits, doc[1:]).sum().item()
            count += len(doc) - 1
    return total / count


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_first_loss_equals_the_documents_run_alone_and_steps_lower_it(kind, packing, tmp_path):
    tokenizer = tokenizer_for(kind)
    model = tiny_model(kind, tokenizer)
    train = datasets.Dataset.from_dict({"text": documents(4)})
    args = SFTConfig(**common_args(tmp_path, per_device_train_batch_size=4 if not packing else 2),
                     packing=packing, max_length=128, padding_free=packing)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    recorder = Recorder(trainer.compute_loss)
    trainer.compute_loss = recorder
    trainer.train()
    losses = [call[2].item() for call in recorder.calls]
    first_inputs = recorder.calls[0][0][1]
    docs = document_rows(first_inputs)
    if packing:  # one flattened row carrying every document, positions restarting at each
        assert first_inputs["input_ids"].shape[0] == 1 and len(docs) == 4
    else:
        assert first_inputs["input_ids"].shape[0] == 4 and (first_inputs["attention_mask"] == 0).any()
    # the first step ran on the initial weights: replay it on a fresh model with the same seed
    fresh = tiny_model(kind, tokenizer)
    alone = per_document_loss(fresh, docs)
    assert losses[0] == pytest.approx(alone, abs=ATOL)
    print(f"SFT {kind} {'packed' if packing else 'padded'}: first loss {losses[0]:.6f}, documents alone "
          f"{alone:.6f} (|difference| {abs(losses[0] - alone):.1e}), losses {[round(x, 3) for x in losses]}")
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, losses


# ----- DPO ------------------------------------------------------------------------------------------------------
def preference_pairs(count: int) -> datasets.Dataset:
    lines = support.corpus_lines()
    rows = [(" ".join(lines[i].split()[:6]), " ".join(lines[i].split()[6:12]), " ".join(lines[i + 1].split()[6:10]))
            for i in range(count)]
    return datasets.Dataset.from_dict({key: [row[j] for row in rows] for j, key in
                                       enumerate(("prompt", "chosen", "rejected"))})


@pytest.mark.parametrize("kind", KINDS)
def test_dpo_log_probs_are_the_models_own_and_steps_run(kind, tmp_path):
    tokenizer = tokenizer_for(kind)
    model = tiny_model(kind, tokenizer)
    args = DPOConfig(**common_args(tmp_path, per_device_train_batch_size=2, max_steps=2), beta=0.1,
                     gradient_checkpointing=False, max_length=64)
    reference = tiny_model(kind, tokenizer)  # TRL would reload the model by name; ours are built here
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=preference_pairs(4),
                         processing_class=tokenizer)
    calls = record_calls(model)
    trainer.train()
    calls.handle.remove()
    fused = [call for call in calls if call[1].get("fused_lm_head")]
    assert fused, "DPO scored nothing through the model"
    # the first call ran on the initial weights (a fresh model with the same seed has them): the chosen and
    # rejected rows of both pairs, in one forward, score as the model's own plain forward scores them
    _, kwargs, output, _ = fused[0]
    labels = kwargs["labels"]
    assert labels.shape[0] == 4
    inputs = {key: value for key, value in kwargs.items() if key not in ("labels", "fused_lm_head")}
    with torch.no_grad():
        logits = plain_forward(tiny_model(kind, tokenizer))(**inputs).logits
    mask = labels[:, 1:] != -100
    own = token_log_probs(logits[:, :-1], labels[:, 1:].clamp(min=0))
    difference = (output.log_probs.detach()[mask] - own[mask]).abs().max().item()
    assert difference < ATOL, difference
    print(f"DPO {kind}: max |TRL - own| log-prob {difference:.2e}")
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in trainer.state.log_history if "loss" in entry)


# ----- GRPO -----------------------------------------------------------------------------------------------------
def length_reward(completions, **kwargs) -> list[float]:
    """Any reward will do: the test checks the log-probs and ratios, not what is learned."""
    return [float(len(completion)) for completion in completions]


def run_grpo(kind: str, tmp_path, **config_overrides):
    """Two GRPO steps on four prompts (two completions each, sampled by the model's own generate()), recording what
    generate() sampled from (its raw logits) and every per-token log-prob TRL computed (no-grad: the old policy;
    with grad: the loss's). Two iterations per generation make TRL score the old policy itself."""
    tokenizer = tokenizer_for(kind)
    model = tiny_model(kind, tokenizer, **config_overrides)
    prompts = [" ".join(line.split()[:5]) for line in documents(4)]
    args = GRPOConfig(**common_args(tmp_path, per_device_train_batch_size=4, max_steps=2), num_generations=2,
                      max_completion_length=8, num_iterations=2, temperature=0.9, top_k=0, top_p=1.0,
                      gradient_checkpointing=False, beta=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    sampled = []
    generate = model.generate

    def generate_with_logits(*args, **kwargs):
        out = generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
        sampled.append((out.sequences, torch.stack(out.logits, dim=1)))
        return out.sequences

    model.generate = generate_with_logits
    scored = Recorder(trainer._get_per_token_logps_and_entropies)
    trainer._get_per_token_logps_and_entropies = scored
    trainer.train()
    return trainer, sampled, scored.calls


def scored_rows(call):
    """(input ids, attention mask, per-token log-probs) of one recorded `_get_per_token_logps_and_entropies` call."""
    args, kwargs, (log_probs, _, _), _ = call
    names = ("input_ids", "attention_mask")
    values = dict(zip(names, args[1:3]), **{name: kwargs[name] for name in names if name in kwargs})
    return values["input_ids"], values["attention_mask"], log_probs


def sampled_log_probs(sequences, logits, temperature: float):
    """log p(sampled token) under the distribution generate() sampled from (raw logits / temperature)."""
    completion = sequences[:, -logits.shape[1]:]
    return token_log_probs(logits / temperature, completion)


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_log_probs_equal_generate_and_first_ratios_are_one(kind, tmp_path):
    # KVM soft-caps here too, so TRL must read the cap under transformers' name; Maglev scores with P recurrent
    overrides = dict(logit_softcap=10.0) if kind == "kvm" else dict(training_forward="recurrent")
    trainer, sampled, scored = run_grpo(kind, tmp_path, **overrides)
    sequences, logits = sampled[0]
    old = [call for call in scored if not call[3]]
    new = [call for call in scored if call[3]]
    assert old and new, "TRL computed no old-policy log-probs (num_iterations > 1 should make it)"
    old_ids, old_mask, old_log_probs = scored_rows(old[0])
    width = logits.shape[1]
    assert torch.equal(old_ids[:, -width:], sequences[:, -width:])  # TRL scored what generate() sampled
    mask = old_mask[:, -width:].bool()
    behaviour = sampled_log_probs(sequences, logits, 0.9)
    difference = (old_log_probs[mask] - behaviour[mask]).abs().max().item()
    assert difference < ATOL, difference
    # the loss's log-probs at the first step: same weights, so every importance ratio is 1 (TRL shuffles the rows)
    new_ids, _, new_log_probs = scored_rows(new[0])
    order = [next(i for i in range(len(old_ids)) if torch.equal(old_ids[i], row)) for row in new_ids]
    ratio = torch.exp(new_log_probs.detach() - old_log_probs[order])[mask[order]]
    assert (ratio - 1).abs().max().item() < ATOL
    print(f"GRPO {kind}: max |TRL - generate| log-prob {difference:.2e}, max |ratio - 1| "
          f"{(ratio - 1).abs().max().item():.2e}")
