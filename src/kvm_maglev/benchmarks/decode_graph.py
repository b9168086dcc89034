"""One Maglev decode step as torch sees it (docs/serving.md, "Maglev decode step as one graph"): graph breaks of a
generate() decode step under `torch._dynamo.explain`, aten calls of one `model(token, past_key_values=cache)` step
after a prompt (leaf calls under a TorchDispatchMode, and the profiler's aten events, nested ones included; Llama's
of the same shape for reference), and the median step time at a long context, eager and compiled.

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout>/src python src/kvm_maglev/benchmarks/decode_graph.py --compile

Runnable as a file so the same measurement runs on an older checkout (one without prepared steps gets no compiled
time). The shape is the serving benchmark's: hidden 256, 4 layers, 4 query / 2 key-value heads, vocabulary 4096,
window 128, float32, random weights.
"""

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32768)


class CallCounter(TorchDispatchMode):
    """Counts the aten calls dispatched inside it (the leaf calls a backend runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def maglev(shape: dict) -> torch.nn.Module:
    from kvm_maglev.models.maglev import MaglevConfig, MaglevForCausalLM

    torch.manual_seed(0)
    return MaglevForCausalLM(MaglevConfig(sliding_window=128, **shape)).eval()


def llama(shape: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(intermediate_size=4 * shape["hidden_size"], **shape)).eval()


@torch.no_grad()
def step_calls(model: torch.nn.Module, cache, prompt: int = 32) -> dict:
    """Aten calls of the second and third decode steps after a prompt: dispatched leaf calls, profiler events."""
    out = model(torch.randint(0, model.config.vocab_size, (1, prompt)), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    with CallCounter() as counter:
        logits = model(token, past_key_values=cache).logits
    token = logits[:, -1:].argmax(-1)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        model(token, past_key_values=cache)
    events = sum(1 for event in profiler.events() if event.name.startswith("aten::"))
    return {"dispatched": counter.calls, "profiler_events": events}


@torch.no_grad()
def graph_breaks(model: torch.nn.Module) -> dict:
    """`torch._dynamo.explain` of the forward generate() runs for a decode step of a left-padded batch of 2."""
    prompt = torch.randint(0, model.config.vocab_size, (2, 20))
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    mask = torch.cat([mask, torch.ones_like(out.sequences[:, 20:])], dim=1)
    inputs = model.prepare_inputs_for_generation(out.sequences, next_sequence_length=1, cache=cache,
                                                 attention_mask=mask, use_cache=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "ops_in_graphs": explained.op_count}


@torch.no_grad()
def step_times(model: torch.nn.Module, context: int, steps: int, compiled: bool) -> dict:
    """Median milliseconds of a decode step at `context` tokens, batch 1, wall and CPU time (the process's: other
    jobs on the machine move it less): eager, and (`compiled`, on a checkout with prepared steps)
    `torch.compile(forward, fullgraph=True)` of the prepared step; eager again after it."""
    from kvm_maglev.models.maglev.cache_maglev import MaglevCache

    cache = MaglevCache(model.config)
    out = model(torch.randint(0, model.config.vocab_size, (1, context)), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)

    def medians(forward, prepare: bool) -> dict:
        nonlocal token
        wall, cpu = [], []
        for i in range(steps + 5):  # 5 warm-up steps
            start, start_cpu = time.perf_counter(), time.process_time()
            if prepare:
                model.model.prepare_step(token, cache)
            token = forward(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            if i >= 5:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        return {"wall_ms": round(statistics.median(wall) * 1e3, 3), "cpu_ms": round(statistics.median(cpu) * 1e3, 3)}

    result = {"eager": medians(model, False)}
    if compiled and hasattr(model.model, "prepare_step"):
        result["compiled"] = medians(torch.compile(model.forward, fullgraph=True), True)
        result["eager_again"] = medians(model, False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens read before the timed steps")
    parser.add_argument("--steps", type=int, default=300, help="timed steps (the median is reported)")
    parser.add_argument("--compile", action="store_true", help="also time the step under torch.compile")
    parser.add_argument("--out", help="a JSON file for the results (default: print them)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from kvm_maglev.models.maglev.cache_maglev import MaglevCache
    from transformers import DynamicCache

    model, reference = maglev(SHAPE), llama(SHAPE)
    results = {
        "maglev_calls": step_calls(model, MaglevCache(model.config)),
        "llama_calls": step_calls(reference, DynamicCache(config=reference.config)),
        "maglev_explain": graph_breaks(model),
        "maglev_step": step_times(model, args.context, args.steps, args.compile),
        "context": args.context, "torch": torch.__version__,
    }
    text = json.dumps(results, indent=2)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
