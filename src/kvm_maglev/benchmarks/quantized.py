"""Both models quantized at load time by transformers' quantizers (issue 56), measured per method:

- coverage: the decoder projections each method converts, of those it should (every linear layer but the declared
  full-precision gates and the head), on the package's saved folder and on a generated Hub folder (its own code);
- memory: the decoder layers' weight bytes (the quantized tensors' own storage and scales), against bfloat16;
- quality: on random weights at the 120M width (hidden 768, `--layers` layers), the logits' largest and mean
  difference from float32 (relative to the float logits' largest and standard deviation) and the top-1 agreement;
  on the package's trained recall models (hidden 64, `assets/recall_models`), the loss on the recalled values;
- speed: greedy generate() of `--new-tokens` tokens after a 32-token prompt, ms per token (one process, the
  machine's threads; a shared machine: read the ratios, not the absolute times);
- whether generate() works at hidden 768 (torchao int8 crashed in the oneDNN speed-up before).

    nice python -m kvm_maglev.benchmarks.quantized --out docs/quantized.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

# the package's trained recall models (hidden 64), one per architecture
RECALL_MODELS = {kind: Path(__file__).resolve().parents[1] / "assets" / "recall_models" / name
                 for kind, name in (("kvm", "kvm_fixed"), ("maglev", "maglev"))}
METHODS = ("bnb_nf4", "bnb_fp4", "bnb_int8", "torchao_int8_weight_only", "torchao_int8_dynamic", "torchao_int4_cpu",
           "quanto_int8", "quanto_int4")
KEPT = {"kvm": ("merge_gate_proj", "value_gate_up"), "maglev": ("memory_gate", "value_gate", "smear_gate")}


def quantization_config(method: str):
    """transformers' config of `method` (bitsandbytes 4-bit double-quantized nf4 / fp4 and 8-bit; torchao int8
    weight-only, int8 dynamic activations, int4 weights in groups of 32 on CPU; quanto int8 / int4)."""
    if method.startswith("bnb"):
        from transformers import BitsAndBytesConfig

        return {"bnb_nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                              bnb_4bit_use_double_quant=True),
                "bnb_fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
                "bnb_int8": BitsAndBytesConfig(load_in_8bit=True)}[method]
    if method.startswith("torchao"):
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            IntxWeightOnlyConfig,
        )
        from torchao.quantization.granularity import PerGroup
        from transformers import TorchAoConfig

        return TorchAoConfig({"torchao_int8_weight_only": Int8WeightOnlyConfig,
                              "torchao_int8_dynamic": Int8DynamicActivationInt8WeightConfig,
                              "torchao_int4_cpu": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                               granularity=PerGroup(32))}[method]())
    from transformers import QuantoConfig

    return QuantoConfig(weights={"quanto_int8": "int8", "quanto_int4": "int4"}[method])


def random_model(kind: str, layers: int) -> nn.Module:
    """A `kind` model at hidden 768 (KVM's research 120M shape; Maglev's d12 width) with every parameter moved off
    its initial value (zero output projections and gates), float32."""
    from kvm_maglev.models.kvm import KVMConfig, KVMForCausalLM
    from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM

    torch.manual_seed(0)
    if kind == "kvm":
        model = KVMForCausalLM(KVMConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=6))
    else:
        model = MaglevForCausalLM(MaglevConfig(hidden_size=768, num_hidden_layers=layers, num_attention_heads=6,
                                               num_key_value_heads=6))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model.eval()


def is_quantized(module: nn.Module) -> bool:
    from kvm_maglev.models.common.conventions import FullPrecisionLinear

    weight = getattr(module, "weight", None)
    return type(module) not in (nn.Linear, FullPrecisionLinear) or type(weight) not in (torch.Tensor, nn.Parameter)


def projections(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder layers' linear layers by name (the head and the top-level smear gate are outside them)."""
    return {name: module for name, module in model.named_modules()
            if name.startswith("model.layers.") and (isinstance(module, nn.Linear) or "Linear" in type(module).__name__)}


def coverage(kind: str, model: nn.Module) -> dict:
    """Quantized decoder projections against those that should be (all but the declared kept gates)."""
    layers = projections(model)
    due = {name for name in layers if name.rsplit(".", 1)[-1] not in KEPT[kind]}
    done = {name for name, module in layers.items() if is_quantized(module)}
    return {"quantized": len(done & due), "due": len(due), "kept_quantized": len(done - due),
            "head_quantized": is_quantized(model.lm_head)}


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Storage bytes of `tensor`; a tensor subclass (torchao's, quanto's) counts the tensors it holds."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def decoder_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' state: parameters, buffers and bitsandbytes' quantization statistics."""
    total = 0
    for name, module in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            total += tensor_bytes(tensor)
        state = getattr(getattr(module, "weight", None), "quant_state", None)  # bitsandbytes 4-bit
        if state is not None:
            total += sum(tensor_bytes(t) for t in state.as_dict(packed=True).values() if isinstance(t, torch.Tensor))
        statistics = getattr(getattr(module, "weight", None), "SCB", None)  # bitsandbytes 8-bit row scales
        if isinstance(statistics, torch.Tensor):
            total += tensor_bytes(statistics)
    return total


def load(folder: Path, method: str | None, hub: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if method is not None:
        kwargs["quantization_config"] = quantization_config(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=hub, **kwargs).eval()


@torch.no_grad()
def logit_difference(model: nn.Module, reference: torch.Tensor, ids: torch.Tensor) -> dict:
    logits = model(ids, use_cache=False).logits.float()
    return {"max_rel": float((logits - reference).abs().max() / reference.abs().max()),
            "mean_rel_std": float((logits - reference).abs().mean() / reference.std()),
            "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).float().mean())}


def ms_per_token(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    settings = dict(attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    model.generate(prompt, max_new_tokens=2, **settings)  # warm-up
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)
    return 1000 * (time.perf_counter() - start) / (out.shape[1] - prompt.shape[1])


@torch.no_grad()
def recall_loss(model: nn.Module, batch: dict) -> float:
    return float(model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss)


def recall_batch(folder: Path, examples: int) -> dict:
    """Recall examples of the model's own task (queries at its trained distances), as one batch."""
    from kvm_maglev.recall import RecallTask, make_example

    spec = json.loads((folder / "recall_task.json").read_text())
    task, generator = RecallTask(**spec["task"]), torch.Generator().manual_seed(123)
    rows = [make_example(task, generator, spec["distances"]) for _ in range(examples)]
    return {"input_ids": torch.tensor([row.input_ids for row in rows]),
            "labels": torch.tensor([row.labels for row in rows])}


def run_method(kind: str, method: str, folders: dict, reference: torch.Tensor, ids: torch.Tensor,
               prompt: torch.Tensor, args) -> dict:
    """Every measure of one method on one model; an error is recorded by its message."""
    row: dict = {"method": method}
    try:
        model = load(folders["package"], method)
        row["package"] = coverage(kind, model)
        row["logits"] = logit_difference(model, reference, ids)
        row["generate_ms_per_token"] = ms_per_token(model, prompt, args.new_tokens)
        row["decoder_bytes"] = decoder_bytes(model)
        del model
        if method.startswith("bnb_nf4") or method.startswith("bnb_fp4"):  # 4-bit, the rest in bfloat16
            row["decoder_bytes_bf16_compute"] = decoder_bytes(load(folders["package"], method, dtype=torch.bfloat16))
        row["hub_folder"] = coverage(kind, load(folders["hub"], method, hub=True))
        trained = RECALL_MODELS[kind]
        row["recall_loss"] = recall_loss(load(trained, method), folders["recall_batch"])
    except Exception as error:  # a method that fails is a result, recorded
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    print(json.dumps({"model": kind, **row}), flush=True)
    return row


def bench_model(kind: str, args, scratch: Path, save) -> dict:
    from kvm_maglev.convert.export import build_hub_folder

    model = random_model(kind, args.layers)
    folders = {"package": scratch / f"{kind}_package", "hub": scratch / f"{kind}_hub"}
    model.save_pretrained(folders["package"])
    build_hub_folder(model, folders["hub"], progress=False)
    trained = RECALL_MODELS[kind]
    folders["recall_batch"] = recall_batch(trained, args.recall_examples)
    ids = torch.randint(1, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    prompt = ids[:1, :32]
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.float()
    result = {"float32": {"decoder_bytes": decoder_bytes(model),
                          "generate_ms_per_token": ms_per_token(model, prompt, args.new_tokens),
                          "recall_loss": recall_loss(load(trained, None), folders["recall_batch"])},
              "bfloat16": {"decoder_bytes": decoder_bytes(load(folders["package"], None, dtype=torch.bfloat16))},
              "methods": []}
    del model
    print(json.dumps({"model": kind, "float32": result["float32"], "bfloat16": result["bfloat16"]}), flush=True)
    save(kind, result)
    for method in args.methods:  # each row saved as it comes: a long run stopped early keeps what it measured
        result["methods"].append(run_method(kind, method, folders, reference, ids, prompt, args))
        save(kind, result)
    return result



def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["kvm", "maglev"], choices=["kvm", "maglev"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the hidden-768 random models")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--recall-examples", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    import transformers

    from kvm_maglev import register_auto_classes

    register_auto_classes()  # the package's folders load as the package's classes

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for package in ("bitsandbytes", "torchao", "optimum.quanto"):
        try:
            versions[package] = __import__(package, fromlist=["__version__"]).__version__
        except ImportError:
            versions[package] = None
    result = {"command": "python -m kvm_maglev.benchmarks.quantized " + " ".join(argv or sys.argv[1:]),
              "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
              "versions": versions, "layers": args.layers, "models": {}}

    def save(kind: str, measured: dict) -> None:
        result["models"][kind] = measured
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")

    with tempfile.TemporaryDirectory() as scratch:
        for kind in args.models:
            bench_model(kind, args, Path(scratch), save)
    return result


if __name__ == "__main__":
    main()
