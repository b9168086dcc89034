"""PEFT: LoRA (documented target modules, training, adapter save/reload, merge, generate), PEFT's default targets
for LoRA / DoRA / IA3, prompt tuning and P-tuning on KVM, and the methods refused with an error naming them."""

import peft
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvm_maglev.training import group_texts_dataset, lora_target_modules
from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def prompt_ids(folder, length=10) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return torch.tensor([tokenizer(support.corpus_lines()[3], add_special_tokens=False)["input_ids"][:length]])


def test_documented_targets_cover_attention_mlp_and_memory(model_dir):
    model = load(model_dir)
    names = lora_target_modules(model)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"} <= set(names)
    if model.config.model_type == "maglev":
        assert {"memory_k_proj", "memory_v_proj"} <= set(names)
        assert "memory_k_proj" not in lora_target_modules(model, groups=["attention", "mlp"])
    with pytest.raises(ValueError, match="unknown LoRA group"):
        lora_target_modules(model, groups=["embeddings"])
    with pytest.raises(ValueError, match="no documented LoRA target modules"):
        lora_target_modules(nn.Linear(2, 2))


def test_maglev_without_memory_gets_no_memory_targets():
    from kvm_maglev import MaglevConfig, MaglevForCausalLM

    config = MaglevConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          smear_gate_channels=12, use_memory=False, sliding_window=None, has_prefiller=False)
    model = MaglevForCausalLM(config)
    assert lora_target_modules(model) == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="memory_k_proj"):
        lora_target_modules(model, groups=["memory"])


def test_lora_trainable_parameter_count(model_dir):
    model = load(model_dir)
    targets = lora_target_modules(model)
    rank = 4
    expected = sum(
        rank * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    lora_model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=8, target_modules=targets,
                                                            task_type="CAUSAL_LM"))
    trainable, total = lora_model.get_nb_trainable_parameters()
    assert trainable == expected > 0
    assert all(("lora_" in name) == p.requires_grad for name, p in lora_model.named_parameters())


def test_lora_example_trains_saves_reloads_merges_and_generates(model_dir, tmp_path):
    example = support.load_example("finetune")
    out = tmp_path / "lora"
    argv = ["--model", str(model_dir), "--output-dir", str(out), "--block-size", str(support.training_block_size(model_dir)),
    "--max-steps", "4",
            "--batch-size", "2", "--learning-rate", "1e-2", "--eval-fraction", "0", "--save-steps", "4",
            "--lora", "--lora-rank", "4", "--merge-lora"]
    base = load(model_dir)
    assert example.main(argv) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    # the adapter goes onto a fresh base; the base's own weights stay as they were
    base_state = {name: p.clone() for name, p in load(model_dir).state_dict().items()}
    adapted = peft.PeftModel.from_pretrained(load(model_dir), out).eval()
    trained_b = [p for name, p in adapted.named_parameters() if "lora_B" in name]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)  # B starts at zero: it was trained
    for name, tensor in adapted.get_base_model().state_dict().items():
        if "lora_" not in name and name.replace(".base_layer", "") in base_state:
            assert torch.equal(tensor, base_state[name.replace(".base_layer", "")]), name

    ids = prompt_ids(model_dir)
    with torch.no_grad():
        adapter_logits = adapted(input_ids=ids).logits
        base_logits = base(input_ids=ids).logits
        merged = load(out / "merged")
        merged_logits = merged(input_ids=ids).logits
    assert (adapter_logits - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=1e-5)

    # merge_and_unload in memory as well, then generate through the PeftModel and the merged model
    in_memory = peft.PeftModel.from_pretrained(load(model_dir), out).eval()
    generated = adapted.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    merged_in_memory = in_memory.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged_in_memory(input_ids=ids).logits, adapter_logits, atol=1e-5, rtol=1e-5)
    assert generated.shape[0] == 1 and generated.shape[1] > ids.shape[1]
    assert torch.equal(generated, merged.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


def training_ids(folder) -> torch.Tensor:
    """Two packed blocks of the corpus, long enough that KVM's state is written and read."""
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    blocks = group_texts_dataset(support.corpus_lines(), tokenizer, support.training_block_size(folder))
    return torch.tensor(blocks["input_ids"][:2])


def train_step_save_and_reload(folder, config, out) -> None:
    """One AdamW step on the adapter (finite loss, the adapter alone trainable and moved), then save_pretrained
    and PeftModel.from_pretrained onto a fresh base give the same logits."""
    model = peft.get_peft_model(load(folder).train(), config)
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and sum(p.numel() for p in trainable.values()) < sum(p.numel() for p in model.parameters())
    ids = training_ids(folder)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    moved = [name for name, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[name])]
    assert moved
    model.eval().save_pretrained(out)
    reloaded = peft.PeftModel.from_pretrained(load(folder), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["lora", "dora", "ia3"])
def test_peft_default_targets_without_target_modules(model_dir, tmp_path, method):
    """LoraConfig() / IA3Config() without target_modules take the defaults kvm_maglev.training registers in
    PEFT's tables: LoRA and DoRA every documented linear layer, IA3 keys, values and down projections."""
    configs = {"lora": lambda: peft.LoraConfig(r=4, task_type="CAUSAL_LM"),
               "dora": lambda: peft.LoraConfig(r=4, use_dora=True, task_type="CAUSAL_LM"),
               "ia3": lambda: peft.IA3Config(task_type="CAUSAL_LM")}
    model = peft.get_peft_model(load(model_dir), configs[method]())
    expected = set(lora_target_modules(load(model_dir))) if method != "ia3" else {"k_proj", "v_proj", "down_proj"}
    targeted = {name.rsplit(".", 1)[-1] for name in model.base_model.targeted_module_names}
    assert targeted == expected
    train_step_save_and_reload(model_dir, configs[method](), tmp_path / method)


def test_ia3_with_explicit_targets(model_dir, tmp_path):
    config = peft.IA3Config(target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                            feedforward_modules=["up_proj", "down_proj"], task_type="CAUSAL_LM")
    train_step_save_and_reload(model_dir, config, tmp_path / "ia3")


def test_lora_all_linear_targets_every_linear_layer_but_the_head(model_dir, tmp_path):
    config = peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(load(model_dir), config)
    linear = {name for name, module in load(model_dir).named_modules() if isinstance(module, nn.Linear)}
    assert set(model.base_model.targeted_module_names) == linear - {"lm_head"}
    train_step_save_and_reload(model_dir, config, tmp_path / "all_linear")


PROMPT_LEARNING = {
    "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "p_tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
}


@pytest.mark.parametrize("method", sorted(PROMPT_LEARNING))
def test_prompt_learning_trains_on_kvm_and_is_refused_by_maglev(model_dir, tmp_path, method):
    """KVM reads inputs_embeds, so learned virtual tokens in front of the prompt train and reload; Maglev reads
    token ids only (value embeddings, smear) and refuses with an error naming the PEFT methods and LoRA."""
    if load(model_dir).config.model_type == "kvm":
        train_step_save_and_reload(model_dir, PROMPT_LEARNING[method](), tmp_path / method)
        return
    base = load(model_dir)
    # PEFT finds the word embeddings as the table of vocab_size rows: a vocabulary that fills its rows, as
    # nanochat's 65536 ids do (this one is padded to pad_vocab_size_to, docs/training.md)
    base.resize_token_embeddings(base.config.vocab_size)
    model = peft.get_peft_model(base, PROMPT_LEARNING[method]())
    ids = training_ids(model_dir)
    with pytest.raises(ValueError, match="PEFT prompt tuning and P-tuning .* do not apply to Maglev: use LoRA"):
        model(input_ids=ids, labels=ids)


def test_prefix_tuning_is_refused_naming_the_method(model_dir):
    """PEFT prefix tuning hands the model a DynamicCache of learned per-layer keys/values, which has no place
    in KVM's state or Maglev's memory cache: refused with an error naming prefix tuning and LoRA."""
    model = peft.get_peft_model(load(model_dir), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    ids = training_ids(model_dir)
    with pytest.raises(TypeError, match="got DynamicCache: .*PEFT prefix tuning does not apply; use LoRA"):
        model(input_ids=ids, labels=ids)
