"""One cached decode step under generate()'s cache, seen the way a compiler and a GPU see it: dynamo's graphs and
graph breaks (and those of a prompt forward), the aten calls an eager step makes (each one a kernel launch on a GPU: leaf calls under a
TorchDispatchMode, and the profiler's aten events, nested ones included), and the median time (wall and the
process's CPU time) of an eager and a `torch.compile`d step after a prompt.

    python -m kvm_maglev.benchmarks.step_graphs --context 4096 --out docs/bench_step_graphs.json
    PYTHONPATH=<older checkout>/src python src/kvm_maglev/benchmarks/step_graphs.py ...  # runnable as a file

Models: the serving benchmark's shape (hidden 256, 4 layers, 4 query / 2 key-value heads, vocabulary 4096, float32,
random weights): KVM with KVMConfig's defaults (chunks of 256, a 2-chunk window, a fixed 256-slot state), Maglev
(window 128), and transformers' Llama and Mistral (window 128) with the StaticCache of transformers' compiled
decoding.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationMixin

from kvm_maglev.models.common.transformers_versions import GENERATE_CACHE_KWARG

NEXT_LENGTH = "next_sequence_length" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
# the serving benchmark's shape (KVM: chunks of 256, a 2-chunk window, a 256-slot state; windows of 128), and a tiny one
SHAPES = {"serving": (dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2), 128, {}),
          "tiny": (dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2), 8, dict(chunk_size=4, state_budget_min=4))}
MODELS = ("kvm", "maglev", "llama", "mistral")


def build(name: str, shape: str = "serving") -> torch.nn.Module:
    """A random-weight model of one of SHAPES."""
    fields, window, kvm_fields = SHAPES[shape]
    torch.manual_seed(0)
    if name == "kvm":
        from kvm_maglev import KVMConfig, KVMForCausalLM

        return KVMForCausalLM(KVMConfig(**fields, **kvm_fields)).eval()
    if name == "maglev":
        from kvm_maglev import MaglevConfig, MaglevForCausalLM

        return MaglevForCausalLM(MaglevConfig(**fields, sliding_window=window, has_prefiller=False,
                                              max_position_embeddings=1 << 16)).eval()
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(fields, intermediate_size=4 * fields["hidden_size"], max_position_embeddings=1 << 16,
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=window)).eval()
    raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def new_cache(model: torch.nn.Module, max_len: int):
    """Our models' own caches; for transformers' models the cache their compiled decoding uses, a StaticCache of
    `max_len` tokens (fixed shapes from step to step)."""
    cache_class = getattr(model, "cache_class", None)
    if cache_class is not None:
        return cache_class(model.config)
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


class DecodeLoop:
    """A model and its cache after a prompt, stepped one greedy token at a time through `step(forward)`, as
    generate() steps it (prepare_inputs_for_generation, then the forward)."""

    def __init__(self, model: torch.nn.Module, context: int, max_len: int, batch: int = 1) -> None:
        self.model = model
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=generator)
        self.cache = new_cache(model, max_len)
        with torch.no_grad():
            logits = model(ids, **{GENERATE_CACHE_KWARG: self.cache}, use_cache=True).logits
        self.ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)

    @torch.no_grad()  # as generate() prepares them
    def inputs(self) -> dict:
        """The keywords generate() would give the forward for the next token."""
        length = self.ids.shape[1]
        # transformers 5.25 slices the inputs by `next_sequence_length`, older releases by `cache_position`
        slicing = {"next_sequence_length": 1} if NEXT_LENGTH else {"cache_position": torch.arange(length - 1, length)}
        inputs = self.model.prepare_inputs_for_generation(
            self.ids, **{GENERATE_CACHE_KWARG: self.cache}, attention_mask=torch.ones_like(self.ids), use_cache=True,
            **slicing)
        inputs.pop("cache_position", None)
        return inputs

    @torch.no_grad()
    def step(self, forward: Callable | None = None) -> torch.Tensor:
        logits = (self.model if forward is None else forward)(**self.inputs()).logits
        self.ids = torch.cat([self.ids, logits[:, -1:].argmax(-1)], dim=1)
        return logits


class CountCalls(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def aten_calls(loop: DecodeLoop) -> dict:
    """aten calls of eager decode steps (the forward and what generate() prepares for it): leaf calls, and the
    profiler's aten events of the next step (nested calls counted too)."""
    with CountCalls() as counter:
        loop.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        loop.step()
    return {"dispatched": counter.calls,
            "profiler_events": sum(1 for event in profiler.events() if event.name.startswith("aten::"))}


def graph_breaks(loop: DecodeLoop) -> dict:
    """dynamo's view of one decode step: graphs, breaks and their reasons. Explaining runs the step: the loop
    continues with a repeated token."""
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(loop.model)(**loop.inputs())
    loop.ids = torch.cat([loop.ids, loop.ids[:, -1:]], dim=1)
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "ops": explained.op_count,
            "reasons": sorted({str(reason.reason).splitlines()[0][:160] for reason in explained.break_reasons})}


def prompt_graph_breaks(model: torch.nn.Module, tokens: int) -> dict:
    """dynamo's view of a prompt forward of `tokens` tokens on a fresh cache, prepared as generate() prepares its
    first forward. `ops` counts what the graphs hold: a forward that opts out of compilation (Maglev's recurrent
    prompt) is one graph of a few operations."""
    ids = torch.randint(1, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    cache = new_cache(model, tokens + 16)
    slicing = {"next_sequence_length": tokens} if NEXT_LENGTH else {"cache_position": torch.arange(tokens)}
    torch._dynamo.reset()
    with torch.no_grad():
        inputs = model.prepare_inputs_for_generation(ids, **{GENERATE_CACHE_KWARG: cache}, use_cache=True,
                                                     attention_mask=torch.ones_like(ids), **slicing)
        inputs.pop("cache_position", None)
        explained = torch._dynamo.explain(model)(**inputs)
    return {"tokens": tokens, "graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "ops": explained.op_count,
            "reasons": sorted({str(reason.reason).splitlines()[0][:160] for reason in explained.break_reasons})}


def median_step_ms(loop: DecodeLoop, forward: Callable | None, steps: int) -> dict:
    """Median wall and CPU (this process's: other jobs move it less) milliseconds of `steps` decode steps."""
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loop.step(forward)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"wall_ms": round(1000 * statistics.median(wall), 3), "cpu_ms": round(1000 * statistics.median(cpu), 3)}


def measure(name: str, context: int, steps: int, compiled: bool, shape: str = "serving",
            prompt: int = 1024) -> dict:
    model = build(name, shape)
    result = {"model": name, "prompt_chunk": prompt_graph_breaks(model, prompt)}
    loop = DecodeLoop(model, context, max_len=context + 2 * steps + 16)  # every step this measure takes
    loop.step()  # the first decode step may allocate
    result |= {"aten_calls": aten_calls(loop), **graph_breaks(loop)}
    torch._dynamo.reset()
    result["eager_step"] = median_step_ms(loop, None, steps)
    if compiled:
        forward = torch.compile(model)
        for _ in range(3):  # compile and settle on the dynamic shapes
            loop.step(forward)
        result["compiled_step"] = median_step_ms(loop, forward, steps)
        result["compiled_over_eager_cpu"] = round(result["eager_step"]["cpu_ms"] / result["compiled_step"]["cpu_ms"], 3)
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="serving")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens before the measured steps")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per arm (median)")
    parser.add_argument("--prompt", type=int, default=1024, help="tokens of the prompt forward explained")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile arm")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [measure(name, args.context, args.steps, not args.no_compile, args.shape, args.prompt)
               for name in args.models]
    for result in results:
        print(json.dumps(result))
    if args.out:
        import kvm_maglev

        payload = {"command": "python -m kvm_maglev.benchmarks.step_graphs " + " ".join(argv or sys.argv[1:]),
                   "package": kvm_maglev.__file__, "torch": torch.__version__, "threads": args.threads,
                   "context": args.context, "shape": args.shape, "results": results}
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
