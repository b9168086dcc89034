"""What a user who trusts a Hub folder's code reads and runs, measured: the generated files' lines, the calls one
decoding step makes (as generate() prepares and runs it), and which of the generic `Cache` methods transformers may
call fail without saying why.

    python -m kvm_maglev.benchmarks.trusted_code --out docs/trusted_code.json

Calls: during the forward of one prepared decoding step of the tiny random-weight shape of `step_graphs` (KVM chunks
of 4, windows of 8), after a 20-token prompt and for the next `--steps` steps (a fold boundary among them), the
module calls (every `nn.Module` forward, the model's own included) and the aten operator calls (leaf calls under a
TorchDispatchMode, each a kernel launch on a GPU), of our models and of transformers' Llama and Mistral. They count
the work a step asks for, not how the code is laid out: splitting a function in two changes neither. Cache methods:
each public method and property of transformers' `Cache`, called on a fresh cache and on one after a prompt; an
error counts as a reason when it is NotImplementedError, ValueError or TypeError with a message, and as a failure otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import json
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import Cache

from kvm_maglev.benchmarks.step_graphs import DecodeLoop, build
from kvm_maglev.models import hub_code

MODELS = ("kvm", "maglev", "mistral", "llama")
# arguments for the generic Cache methods the probe calls, by parameter name
PROBE_ARGUMENTS = {"layer_idx": 0, "max_length": 4, "repeats": 1, "query_length": 1, "state_idx": 0,
                   "beam_idx": torch.tensor([0]), "indices": torch.tensor([0]),
                   "key_states": torch.zeros(1, 2, 1, 16), "value_states": torch.zeros(1, 2, 1, 16)}
REASONED = (NotImplementedError, ValueError, TypeError)


class CountOperators(TorchDispatchMode):
    """Counts the aten operators run inside it, by name (`aten.mm`, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_calls(model: torch.nn.Module, inputs: dict) -> tuple[int, Counter[str]]:
    """The module calls and the aten operator calls (by name) of `model(**inputs)`."""
    modules = 0

    def count(module, args):
        nonlocal modules
        modules += 1

    hook = register_module_forward_pre_hook(count)
    try:
        with CountOperators() as operators:
            model(**inputs)
    finally:
        hook.remove()
    return modules, operators.calls


@torch.no_grad()
def decode_calls(name: str, steps: int) -> dict:
    """Module and operator calls of `steps` decoding steps after a 20-token prompt: per step, the most of each, and
    the operators of the step with the most."""
    model = build(name, "tiny")
    loop = DecodeLoop(model, 20, 20 + steps + 8)
    loop.step()
    modules, operators, busiest = [], [], Counter()
    for _ in range(steps):
        module_calls, operator_calls = step_calls(model, loop.inputs())
        modules.append(module_calls)
        operators.append(operator_calls.total())
        busiest = operator_calls if operator_calls.total() > busiest.total() else busiest
        loop.ids = torch.cat([loop.ids, loop.ids[:, -1:]], dim=1)
    return {"module_calls_per_step": modules, "operator_calls_per_step": operators, "max_module_calls": max(modules),
            "max_operator_calls": max(operators), "busiest_step_operators": dict(busiest.most_common())}


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
    parser.add_argument("--steps", type=int, default=6, help="decoding steps whose calls are counted")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    readme = Path(__file__).resolve().parents[3] / "README.md"
    result = {
        "command": "python -m kvm_maglev.benchmarks.trusted_code" + (f" --out {args.out}" if args.out else ""),
        "generated_lines": {f"{kind}/{file}": text.count("\n") for kind in ("kvm", "maglev")
                            for file, text in hub_code.hub_code_files(kind).items()},
        "calls_per_decode_step": {name: decode_calls(name, args.steps) for name in MODELS},
        "cache_methods": {name: cache_methods(name) for name in ("kvm", "maglev")},
        "readme_lines": readme.read_text(encoding="utf-8").count("\n") if readme.exists() else None,
    }
    summary = {"lines": result["generated_lines"],
               "module calls per step (most)": {name: entry["max_module_calls"]
                                                for name, entry in result["calls_per_decode_step"].items()},
               "operator calls per step (most)": {name: entry["max_operator_calls"]
                                                  for name, entry in result["calls_per_decode_step"].items()},
               "cache methods failing": {name: entry["failing_without_reason"]
                                         for name, entry in result["cache_methods"].items()},
               "README lines": result["readme_lines"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
