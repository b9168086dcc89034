"""Quantized like any transformers model (issue 56): transformers' quantizers convert every projection of both models
but the layers the models keep in full precision (`_keep_in_fp32_modules`: the gates; the head by transformers'
default), the quantized models give logits close to float and generate with their caches, a 4-bit model saved after
an eval forward reloads to the same logits, QLoRA trains, and a Hub folder quantizes where the package is absent."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvm_maglev.convert.export import build_hub_folder
from kvm_maglev.models.common.conventions import FullPrecisionLinear, with_head_kept
from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM
from kvm_maglev.models.speedups import onednn_linear
from tests.convert.without_package import run_script

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

# the layers each model declares kept in full precision, by the last component of their names
KEPT = {"kvm": {"merge_gate_proj", "value_gate_up"}, "maglev": {"memory_gate", "value_gate", "smear_gate"}}
VOCAB = 250  # Maglev pads its head's rows to a multiple: unpad_lm_head runs on every load


def tiny(kind: str, hidden: int = 128, layers: int = 2) -> nn.Module:
    """A tiny model of `kind` with every gate the declared lists name, its weights moved off their initial values
    (zero output projections and gates) so that quantization changes the logits."""
    torch.manual_seed(0)
    if kind == "kvm":
        model = KVMForCausalLM(KVMConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=2, rotary_dim=16, chunk_size=4, window_chunks=2,
                                         state_budget_min=4))
    else:
        model = MaglevForCausalLM(MaglevConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                               num_attention_heads=2, num_key_value_heads=2, sliding_window=8,
                                               window_pattern="SL", prefiller_window_pattern="SL"))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module", params=["kvm", "maglev"])
def saved(request, tmp_path_factory):
    """(kind, folder of the package model's save_pretrained, the float model)."""
    model = tiny(request.param)
    folder = tmp_path_factory.mktemp(f"float_{request.param}")
    model.save_pretrained(folder)
    return request.param, folder, model


def quantization_config(method: str):
    """transformers' config of quantization `method`, skipping where its package is not installed."""
    if method.startswith("bnb"):
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig

        return {"bnb_nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_use_double_quant=True),
                "bnb_fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
                "bnb_int8": BitsAndBytesConfig(load_in_8bit=True)}[method]
    if method.startswith("torchao"):
        quantization = pytest.importorskip("torchao.quantization")
        from torchao.quantization.granularity import PerGroup
        from transformers import TorchAoConfig

        return TorchAoConfig({
            "torchao_int8_weight_only": lambda: quantization.Int8WeightOnlyConfig(),
            "torchao_int8_dynamic": lambda: quantization.Int8DynamicActivationInt8WeightConfig(),
            # torchao's int4 on CPU (Int4WeightOnlyConfig needs CUDA or the mslk kernels)
            "torchao_int4_cpu": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                           granularity=PerGroup(32)),
        }[method]())
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    return QuantoConfig(weights={"quanto_int8": "int8", "quanto_int4": "int4"}[method])


# the largest logit difference from float, relative to the largest float logit, each method must stay within
TOLERANCE = {"bnb_nf4": 0.3, "bnb_fp4": 0.4, "bnb_int8": 0.1, "torchao_int8_weight_only": 0.1,
             "torchao_int8_dynamic": 0.15, "torchao_int4_cpu": 0.3, "quanto_int8": 0.1, "quanto_int4": 0.4}
# methods that quantize activations with scales taken over the whole input: a decoding step's one row gets other
# scales than the same row in a full forward, so cached generation agrees with the forward only that closely
ACTIVATION_SCALES = {"torchao_int8_dynamic": 0.05, "bnb_int8": 0.05}  # bnb: outlier columns per input


def is_quantized(module: nn.Module) -> bool:
    """Whether a linear layer was converted: another class (bitsandbytes', quanto's) or a tensor-subclass weight
    (torchao's)."""
    weight = getattr(module, "weight", None)
    return type(module) not in (nn.Linear, FullPrecisionLinear) or type(weight) not in (torch.Tensor, nn.Parameter)


def linear_names(model: nn.Module) -> dict[str, bool]:
    """Each linear layer's name -> whether it is quantized."""
    return {name: is_quantized(module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) or "Linear" in type(module).__name__}


def expected_quantized(kind: str, model: nn.Module, skipped: set[str] = frozenset()) -> set[str]:
    """Every linear layer of the float `model` but the declared kept ones, the head and `skipped`."""
    return {name for name in linear_names(model)
            if name != "lm_head" and name.rsplit(".", 1)[-1] not in KEPT[kind] | skipped}


def load_quantized(folder, kind: str, config) -> nn.Module:
    model_class = KVMForCausalLM if kind == "kvm" else MaglevForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class.from_pretrained(folder, quantization_config=config).eval()


def ids(rows: int = 2, length: int = 14, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def assert_generates_with_cache(model: nn.Module, method: str) -> None:
    """generate() (the model's cache, the runtime block) scores as the uncached forward of its own sequences."""
    prompt = ids(rows=2, length=9, seed=2).clamp(min=1)  # no padding token in it
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        logits = model(out.sequences, use_cache=False).logits[:, prompt.shape[1] - 1:-1].float()
    scores = torch.stack(out.scores, dim=1).float()
    scale = logits.abs().max()
    torch.testing.assert_close(scores / scale, logits / scale, rtol=0, atol=ACTIVATION_SCALES.get(method, 2e-3))


METHODS = ["bnb_nf4", "bnb_fp4", "bnb_int8", "torchao_int8_weight_only", "torchao_int8_dynamic", "torchao_int4_cpu",
           "quanto_int8", "quanto_int4"]


@pytest.mark.parametrize("method", METHODS)
def test_every_projection_but_the_declared_ones_is_quantized(saved, method):
    """The projections of attention, KVM's state path, Maglev's memory and the MLP are converted; the gates and the
    head stay plain float layers; logits stay close to float and cached generation agrees with the forward."""
    kind, folder, float_model = saved
    model = load_quantized(folder, kind, quantization_config(method))
    names = linear_names(model)
    assert {name for name, quantized in names.items() if quantized} == expected_quantized(kind, float_model)
    kept = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in KEPT[kind]]
    assert kept and all(type(module) is FullPrecisionLinear and module.weight.dtype == torch.float32
                        for module in kept)
    with torch.no_grad():
        quantized, expected = model(ids()).logits.float(), float_model(ids()).logits
    difference = float((quantized - expected).abs().max() / expected.abs().max())
    assert 0 < difference < TOLERANCE[method], difference
    assert_generates_with_cache(model, method)


def test_a_users_skip_list_adds_to_the_declared_one(saved):
    """llm_int8_skip_modules names more layers to keep: those stay float too, and the gates and the head are still
    kept (transformers would let the user's list replace its default, the head); the user's config is unchanged."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    kind, folder, float_model = saved
    users = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["o_proj"])
    model = load_quantized(folder, kind, users)
    quantized = {name for name, flag in linear_names(model).items() if flag}
    assert quantized == expected_quantized(kind, float_model, {"o_proj"})
    assert users.llm_int8_skip_modules == ["o_proj"]
    with torch.no_grad():
        logits = model(ids()).logits
    assert logits.shape == (2, 14, VOCAB) and torch.isfinite(logits).all()


def test_a_4bit_model_saved_after_an_eval_forward_reloads_to_the_same_logits(saved, tmp_path):
    """bitsandbytes 0.50 repacks 4-bit weights for AVX512-BF16 CPUs at the first eval forward and its state_dict()
    then writes corrupted weights; the models' from_pretrained turns that repacking off on every 4-bit layer."""
    pytest.importorskip("bitsandbytes")
    kind, folder, _ = saved
    model = load_quantized(folder, kind, quantization_config("bnb_nf4"))
    four_bit = [module for module in model.modules() if hasattr(module, "support_avx512bf16_for_cpu")]
    assert four_bit and not any(module.support_avx512bf16_for_cpu for module in four_bit)
    with torch.no_grad():
        before = model(ids()).logits
    model.save_pretrained(tmp_path / "four_bit")
    reloaded = (KVMForCausalLM if kind == "kvm" else MaglevForCausalLM).from_pretrained(tmp_path / "four_bit").eval()
    assert {name for name, flag in linear_names(reloaded).items() if flag} == {
        name for name, flag in linear_names(model).items() if flag}
    with torch.no_grad():
        assert torch.equal(reloaded(ids()).logits, before)


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
@pytest.mark.parametrize("method", ["torchao_int8_weight_only", "torchao_int8_dynamic"])
def test_torchao_int8_generates_at_hidden_768(kind, method, tmp_path):
    """At hidden 768 the projections are large enough for the oneDNN speed-up: inside generate()'s block it
    takes the plain float head and leaves torchao's int8 weights to their own kernels (it crashed on them)."""
    model = tiny(kind, hidden=768, layers=1)
    model.save_pretrained(tmp_path)
    quantized = load_quantized(tmp_path, kind, quantization_config(method))
    assert quantized.model.layers[0].mlp.up_proj.weight.numel() >= onednn_linear.ONEDNN_MIN_WEIGHTS
    seen = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:
            seen.setdefault(name, type(module))
        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in quantized.named_modules()
             if name in ("lm_head", "model.layers.0.mlp.up_proj")]
    assert_generates_with_cache(quantized, method)
    for hook in hooks:
        hook.remove()
    assert seen == {"lm_head": onednn_linear.OneDNNLinear, "model.layers.0.mlp.up_proj": nn.Linear}
    assert type(quantized.lm_head) is nn.Linear


# a Hub folder quantized by its own code, the package unimportable: the quantized layers' names per method
HUB_SCRIPT = """
import sys, json, warnings, torch
warnings.simplefilter("ignore")
sys.modules["kvm_maglev"] = None
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig
from torchao.quantization import Int8WeightOnlyConfig
report = {}
for name, config in [("bnb_nf4", BitsAndBytesConfig(load_in_4bit=True)), ("bnb_int8", BitsAndBytesConfig(load_in_8bit=True)),
                     ("torchao_int8_weight_only", TorchAoConfig(Int8WeightOnlyConfig()))]:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, quantization_config=config).eval()
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    report[name] = {"module": type(model).__module__, "tokens": out.shape[1],
                    "quantized": sorted(n for n, m in model.named_modules()
                                        if (isinstance(m, torch.nn.Linear) or "Linear" in type(m).__name__)
                                        and (type(m).__name__ not in ("Linear", "FullPrecisionLinear")
                                             or type(m.weight) not in (torch.Tensor, torch.nn.Parameter)))}
print(json.dumps(report))
"""


def test_a_hub_folder_quantizes_without_the_package(saved, tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao")
    kind, _, float_model = saved
    folder = build_hub_folder(float_model, tmp_path / kind, progress=False)
    report = run_script(HUB_SCRIPT, [folder], tmp_path)
    for method, result in report.items():
        assert not result["module"].startswith("kvm_maglev"), method
        assert set(result["quantized"]) == expected_quantized(kind, float_model), method
        assert result["tokens"] == 13, method


def training_rows(count: int = 8, length: int = 24) -> list[dict]:
    """Rows of a repeating 6-token pattern at random offsets: a language a few steps of LoRA learn."""
    pattern = torch.tensor([7, 31, 64, 5, 120, 77]).repeat(length)
    offsets = torch.randint(0, 6, (count,), generator=torch.Generator().manual_seed(4))
    return [{"input_ids": pattern[o:o + length], "labels": pattern[o:o + length]} for o in offsets.tolist()]


def test_qlora_trains_saves_reloads_and_merges_into_the_float_model(saved, tmp_path):
    """4-bit load, prepare_model_for_kbit_training (gradient checkpointing on), LoRA on every projection, Trainer:
    the loss falls; the adapter reloads onto a fresh 4-bit base to the same logits and merges into the float model
    as the unmerged float adapter computes."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from transformers import Trainer, TrainingArguments

    from kvm_maglev.training import lora_target_modules

    kind, folder, _ = saved
    model = peft.prepare_model_for_kbit_training(load_quantized(folder, kind, quantization_config("bnb_nf4")),
                                                 use_gradient_checkpointing=True)
    assert model.is_gradient_checkpointing
    targets = lora_target_modules(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    adapted = {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in lora.named_parameters() if "lora_A" in name}
    assert adapted == set(targets)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=12,
                             learning_rate=2e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = Trainer(model=lora, args=args, train_dataset=training_rows())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    lora.eval().save_pretrained(tmp_path / "adapter")
    probe = ids()
    with torch.no_grad():
        trained = lora(input_ids=probe).logits
        fresh = peft.PeftModel.from_pretrained(load_quantized(folder, kind, quantization_config("bnb_nf4")),
                                               tmp_path / "adapter").eval()
        torch.testing.assert_close(fresh(input_ids=probe).logits, trained, rtol=1e-5, atol=1e-5)
        model_class = KVMForCausalLM if kind == "kvm" else MaglevForCausalLM
        float_adapted = peft.PeftModel.from_pretrained(model_class.from_pretrained(folder), tmp_path / "adapter")
        unmerged = float_adapted.eval()(input_ids=probe).logits
        merged = float_adapted.merge_and_unload()
        assert all(type(module) in (nn.Linear, FullPrecisionLinear) for name, module in merged.named_modules()
                   if isinstance(module, nn.Linear))
        torch.testing.assert_close(merged(input_ids=probe).logits, unmerged, rtol=1e-5, atol=1e-5)
        base = model_class.from_pretrained(folder).eval()(input_ids=probe).logits
    assert (unmerged - base).abs().max() > 1e-2  # the adapter was trained



def test_trl_sft_trainer_trains_a_4bit_model_with_lora(saved, tmp_path):
    """TRL's SFTTrainer on a 4-bit model with a LoRA config (it prepares the model for k-bit training itself), on
    pre-tokenized rows, gradient checkpointing on: the loss falls, only the adapters train, the 4-bit weights stay."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")

    from kvm_maglev.training import lora_target_modules
    from tests.vllm.folders import tiny_tokenizer

    kind, folder, _ = saved
    model = load_quantized(folder, kind, quantization_config("bnb_nf4"))
    packed = [param.detach().clone() for param in model.parameters() if param.dtype == torch.uint8]
    assert packed  # bitsandbytes' 4-bit weights
    rows = datasets.Dataset.from_dict({"input_ids": [row["input_ids"].tolist() for row in training_rows()]})
    args = trl.SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=12,
                         learning_rate=2e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                         bf16=False, disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(model), lora_dropout=0.0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tiny_tokenizer(VOCAB),
                             peft_config=lora)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    trained = {name for name, param in trainer.model.named_parameters() if param.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    after = [param for param in trainer.model.parameters() if param.dtype == torch.uint8]  # in module order
    assert len(after) == len(packed) and all(torch.equal(a, b) for a, b in zip(after, packed))


def test_the_head_joins_a_users_skip_list_in_any_quantizers_field():
    """Each quantization config's own skip-list field (or a dict's key) gains the head; one without a list, or one
    naming the head already, is passed on as given."""
    assert with_head_kept({"quant_method": "bitsandbytes", "llm_int8_skip_modules": ["o_proj"]}) == {
        "quant_method": "bitsandbytes", "llm_int8_skip_modules": ["o_proj", "lm_head"]}
    assert with_head_kept({"modules_to_not_convert": ["gate"]})["modules_to_not_convert"] == ["gate", "lm_head"]
    unset = {"quant_method": "bitsandbytes", "llm_int8_skip_modules": None}
    assert with_head_kept(unset) is unset
    named = SimpleNamespace(skip_modules=["lm_head"])
    assert with_head_kept(named) is named
