"""Run a Hub folder's own code in a fresh interpreter where this package cannot be imported, as a user without it
would: `AutoModelForCausalLM` with `trust_remote_code`, then report whether its outputs equal expected ones."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

SCRIPT = """
import sys, json, torch
sys.modules["kvm_maglev"] = None  # the package cannot be imported: the folder's own code runs
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
expected = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(expected["ids"], use_cache=False).logits
    tokens = model.generate(expected["ids"][:, :9], max_new_tokens=6, do_sample=False)
print(json.dumps({"module": type(model).__module__, "logits": bool(torch.equal(logits, expected["logits"])),
                  "logits_max_difference": float((logits - expected["logits"]).abs().max()),
                  "tokens": bool(torch.equal(tokens, expected["tokens"]))}))
"""


# transformers' own remote-code saving: the loaded model's save_pretrained copies the folder's code files
RESAVE_SCRIPT = """
import sys, json, os, torch
sys.modules["kvm_maglev"] = None
from transformers import AutoModelForCausalLM
first = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
first.save_pretrained(sys.argv[2])
again = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    equal = bool(torch.equal(first(ids).logits, again(ids).logits))
print(json.dumps({"module": type(again).__module__, "logits": equal, "files": sorted(os.listdir(sys.argv[2]))}))
"""


def expected_outputs(model, path: Path) -> None:
    """Save the logits of 23 random tokens and 6 greedy tokens after 9 of them, as `SCRIPT` compares them."""
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids, use_cache=False).logits,
                    "tokens": model.generate(ids[:, :9], max_new_tokens=6, do_sample=False)}, path)


def run_without_package(folder: Path, expected: Path, home: Path) -> dict:
    """The folder's remote code run on the saved inputs: its module, whether logits and tokens are equal, and the
    largest logit difference."""
    return run_script(SCRIPT, [folder, expected], home)


def resave_without_package(folder: Path, out: Path, home: Path) -> dict:
    """The folder loaded with remote code, saved by transformers into `out` and loaded from there: the second
    model's module, whether both give the same logits, and the files `out` holds."""
    return run_script(RESAVE_SCRIPT, [folder, out], home)


def run_script(script: str, args: list[Path], home: Path, env: dict[str, str] | None = None) -> dict:
    """`script` run on `args` in a fresh interpreter where the package cannot be imported (unless `env`, added to
    the interpreter's environment, puts it on PYTHONPATH); its last line, as JSON."""
    env = {"PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
           "HF_HOME": str(home / "hf"), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=sysconfig.get_paths()["stdlib"])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
