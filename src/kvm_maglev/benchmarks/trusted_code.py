"""What a user who trusts a Hub folder's code reads and runs, measured: the generated files' lines, the deepest
chain of the model's own frames in one decoding step (as generate() prepares and runs it), and which of the
generic `Cache` methods transformers may call fail without saying why.

    python -m kvm_maglev.benchmarks.trusted_code --out docs/trusted_code.json

Frames: `sys.setprofile` during the forward of one prepared decoding step of the tiny random-weight shape of
`step_graphs` (KVM chunks of 4, windows of 8), after a 20-token prompt and for the next `--steps` steps (a fold
boundary among them); a frame is the model's own when its code lives in the package (our models) or in
transformers' `models/<name>/` folder (Llama, Mistral). Cache methods: each public method and property of
transformers' `Cache`, called on a fresh cache and on one after a prompt; an error counts as a reason when it is
NotImplementedError, ValueError or TypeError with a message, and as a failure otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import Cache

import kvm_maglev
from kvm_maglev.benchmarks.step_graphs import DecodeLoop, build
from kvm_maglev.models import hub_code

MODELS = ("kvm", "maglev", "mistral", "llama")
# arguments for the generic Cache methods the probe calls, by parameter name
PROBE_ARGUMENTS = {"layer_idx": 0, "max_length": 4, "repeats": 1, "query_length": 1, "state_idx": 0,
                   "beam_idx": torch.tensor([0]), "indices": torch.tensor([0]),
                   "key_states": torch.zeros(1, 2, 1, 16), "value_states": torch.zeros(1, 2, 1, 16)}
REASONED = (NotImplementedError, ValueError, TypeError)


def own_code(model: str) -> Callable[[str], bool]:
    """Whether a frame's file is the model's own code."""
    if model in ("kvm", "maglev"):
        root = os.path.dirname(kvm_maglev.__file__)
    else:
        root = os.path.join(os.path.dirname(transformers.__file__), "models", model)
    return lambda filename: filename.startswith(root + os.sep)


def deepest_own_chain(model: torch.nn.Module, inputs: dict, own: Callable[[str], bool]) -> list[str]:
    """The longest chain of own frames, outermost first, open at once during `model(**inputs)`."""
    stack: list[tuple[bool, str]] = []
    deepest: list[str] = []

    def profile(frame, event, arg):
        nonlocal deepest
        if event == "call":
            code = frame.f_code
            stack.append((own(code.co_filename), f"{os.path.basename(code.co_filename)}:{code.co_qualname}"))
            chain = [name for is_own, name in stack if is_own]
            if len(chain) > len(deepest):
                deepest = chain
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        model(**inputs)
    finally:
        sys.setprofile(None)
    return deepest


@torch.no_grad()
def decode_frames(name: str, steps: int) -> dict:
    """Own-frame depth of `steps` decoding steps after a 20-token prompt: the deepest chain of each, and the
    chain of the deepest step."""
    model = build(name, "tiny")
    loop = DecodeLoop(model, 20, 20 + steps + 8)
    loop.step()
    depths, deepest = [], []
    for _ in range(steps):
        inputs = loop.inputs()
        chain = deepest_own_chain(model, inputs, own_code(name))
        depths.append(len(chain))
        deepest = chain if len(chain) > len(deepest) else deepest
        loop.ids = torch.cat([loop.ids, loop.ids[:, -1:]], dim=1)
    return {"per_step": depths, "max": max(depths), "deepest_chain": deepest}


def probe(cache: Cache, name: str) -> str:
    """'works', 'refused: <reason>' or 'fails: <error>' for generic method or property `name` of `cache`."""
    attribute = inspect.getattr_static(type(cache), name)
    try:
        if isinstance(attribute, property):
            getattr(cache, name)
        else:
            method = getattr(cache, name)
            needed = [parameter.name for parameter in inspect.signature(method).parameters.values()
                      if parameter.default is inspect.Parameter.empty
                      and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
            method(*(PROBE_ARGUMENTS.get(parameter, 0) for parameter in needed))
    except REASONED as error:
        return f"refused: {str(error)[:100]}" if str(error).strip() else f"fails: bare {type(error).__name__}"
    except Exception as error:  # noqa: BLE001 - what the probe counts
        return f"fails: {type(error).__name__}: {str(error)[:100]}"
    return "works"


@torch.no_grad()
def cache_methods(name: str) -> dict:
    """Every generic Cache method and property probed on a fresh cache and on one after a prompt."""
    names = sorted(member for member, value in inspect.getmembers(Cache)
                   if not member.startswith("_") and (callable(value) or isinstance(value, property)))
    results = {}
    for state in ("fresh", "after_prompt"):
        model = build(name, "tiny")
        cache = model.cache_class(model.config) if state == "fresh" else DecodeLoop(model, 12, 64).cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[state] = {member: probe(cache, member) for member in names}
    failing = sorted({member for found in results.values() for member, result in found.items()
                      if result.startswith("fails")})
    return {"failing_without_reason": failing, "results": results}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="decoding steps whose frames are counted")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    readme = Path(__file__).resolve().parents[3] / "README.md"
    result = {
        "command": "python -m kvm_maglev.benchmarks.trusted_code" + (f" --out {args.out}" if args.out else ""),
        "generated_lines": {f"{kind}/{file}": text.count("\n") for kind in ("kvm", "maglev")
                            for file, text in hub_code.hub_code_files(kind).items()},
        "own_frames_per_decode_step": {name: decode_frames(name, args.steps) for name in MODELS},
        "cache_methods": {name: cache_methods(name) for name in ("kvm", "maglev")},
        "readme_lines": readme.read_text(encoding="utf-8").count("\n") if readme.exists() else None,
    }
    summary = {"lines": result["generated_lines"],
               "frames": {name: entry["max"] for name, entry in result["own_frames_per_decode_step"].items()},
               "cache methods failing": {name: entry["failing_without_reason"]
                                         for name, entry in result["cache_methods"].items()},
               "README lines": result["readme_lines"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
