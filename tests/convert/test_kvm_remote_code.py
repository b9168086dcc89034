"""A converted folder loads with trust_remote_code in a fresh Python process where
kvm_maglev cannot be imported, and generates the same tokens as the package's model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kvm_maglev.convert.kvm import convert
from kvm_maglev.models.kvm import KVMForCausalLM

CHILD = r"""
import importlib.util, json, sys
sys.path[:] = json.loads(sys.argv[1])
assert importlib.util.find_spec("kvm_maglev") is None, "kvm_maglev must not be importable here"
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
folder = sys.argv[2]
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert AutoConfig.from_pretrained(folder, trust_remote_code=True).model_type == "kvm"
assert type(AutoModel.from_pretrained(folder, trust_remote_code=True)).__name__ == "KVMModel"
ids = torch.tensor([[5, 17, 3, 200, 9, 41, 7]])
out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
print(json.dumps(out.tolist()))
"""


def package_free_path() -> list[str]:
    """This interpreter's sys.path without the entries that provide kvm_maglev or the tests, nor
    transformers' module cache (an earlier test's remote code puts it there; the child has its own)."""
    spec = importlib.util.find_spec("kvm_maglev")
    package_root = Path(spec.origin).resolve().parent.parent
    tests = Path(__file__).resolve().parents[1]
    kept = []
    for entry in sys.path:
        resolved = Path(entry or os.getcwd()).resolve()
        provides = (resolved / "kvm_maglev").exists() or (resolved / "transformers_modules").exists()
        if resolved in (package_root, tests, tests.parent) or provides:
            continue
        kept.append(str(resolved))
    return kept


def test_converted_folder_loads_and_generates_without_the_package(tmp_path, data_dir):
    case = data_dir / "kvm" / "kvm_saturate_swa" / "research_final"
    folder = convert(case, tmp_path / "converted")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_kvm.py", "modeling_kvm.py"} <= names
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert set(auto_map) >= {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", CHILD, json.dumps(package_free_path()), str(folder)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote_tokens = json.loads(result.stdout.strip().splitlines()[-1])

    model = KVMForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 3, 200, 9, 41, 7]])
    local = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert remote_tokens == local.tolist()
