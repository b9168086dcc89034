"""CI: a Hub folder of each architecture runs in an environment that never had this package.

    python .ci/hub_folder_check.py export DIR   # with the package: tiny folders and the outputs they must give
    python .ci/hub_folder_check.py check DIR    # without it (torch and transformers only): load and compare

`check` loads each folder through `AutoModelForCausalLM` with `trust_remote_code`, so only the folder's two
generated files run; logits and greedy tokens must equal the package model's exactly.
"""

import json
import sys
from pathlib import Path

import torch

KINDS = ("kvm", "maglev")


def tiny_model(kind: str):
    """A small random-weight model of `kind`, its weights moved off their init so every layer matters."""
    from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM

    torch.manual_seed(0)
    if kind == "kvm":
        config = KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, chunk_size=4,
                           sliding_window_every=2, state_budget_mode="power_law", state_max_chunks=8)
        model = KVMForCausalLM(config)
    else:
        config = MaglevConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              sliding_window=4, max_position_embeddings=64)
        model = MaglevForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def outputs(model) -> dict:
    """Logits of 23 tokens without a cache, and 6 greedy tokens after 9 with one."""
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        tokens = model.generate(ids[:, :9], max_new_tokens=6, do_sample=False)
    return {"ids": ids, "logits": logits, "tokens": tokens}


def export(out: Path) -> None:
    from kvm_maglev.convert.export import build_hub_folder

    out.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        folder = build_hub_folder(tiny_model(kind), out / kind, progress=False)
        torch.save(outputs(type(tiny_model(kind)).from_pretrained(folder).eval()), out / f"{kind}.expected.pt")


def check(out: Path) -> None:
    sys.modules["kvm_maglev"] = None  # were it installed after all, importing it would fail here
    from transformers import AutoModelForCausalLM

    report = {}
    for kind in KINDS:
        expected = torch.load(out / f"{kind}.expected.pt")
        model = AutoModelForCausalLM.from_pretrained(out / kind, trust_remote_code=True).eval()
        found = outputs(model)
        report[kind] = {"module": type(model).__module__,
                        "logits": bool(torch.equal(found["logits"], expected["logits"])),
                        "tokens": bool(torch.equal(found["tokens"], expected["tokens"]))}
    print(json.dumps(report))
    failed = [kind for kind, row in report.items()
              if not (row["module"].startswith("transformers_modules.") and row["logits"] and row["tokens"])]
    if failed:
        raise SystemExit(f"Hub folders that do not run on their own or differ from the package: {failed}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "check"):
        raise SystemExit(__doc__)
    (export if sys.argv[1] == "export" else check)(Path(sys.argv[2]))
