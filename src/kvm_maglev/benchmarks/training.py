"""One KVM training step (forward + backward), the authors' research code against ours, on the same weights.

The research code is not shipped: pass a checkout of recursal/KVM-paper with `--research-path`. Both models
are built in this process from the research 120M configs (`kvm_wd`: 256 fixed slots, `kvm_sqrt16_wd`:
16 sqrt(N) slots) with `--layers` layers, float32, the research model's weights copied into ours by the
converter. Steps alternate between the implementations so that both see the same machine; each step's time
and the ratio ours / research are printed and written as JSON. The research code checkpoints every block
in training (`utils.grad_cp.use_grad_cp`); that is switched off here so that both do the same work, unless
`--research-checkpointing` keeps the research code's default (it then recomputes every block's forward).

    python -m kvm_maglev.benchmarks.training --research-path ../KVM-paper --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# the research 120M configs (configs/prolong/120M/*.yaml), model section; num_hidden_layers set by --layers
RESEARCH_FIELDS = dict(
    token_mixer="kvm", vocab_size=50304, num_attention_heads=6, hidden_size=768, ffn_expansion=4,
    use_skip_connections=0, use_block_lambdas=0, logit_softcap=0, use_l2wrap=0, use_tokenshift_att=1,
    use_tokenshift_ffn=1, rope_theta=10000, rope_partial_dim=64, sink_len=1, chunk_len=256, n_bswa_chunks=2,
    state_round_down=1, state_min_len=256, residual_scale=1.0, kvm_apply_merge_gate_to_initial_state=0,
)
BUDGETS = {
    "fixed": dict(n_max_d_chunks=1, state_budget_mode="fixed", state_growth_factor=1.0, state_growth_exponent=0.5),
    "sqrt16": dict(n_max_d_chunks=10000, state_budget_mode="power_law", state_growth_factor=16.0,
                   state_growth_exponent=0.5),
}


def research_model(research_path: Path, fields: dict, seed: int, checkpointing: bool = False) -> torch.nn.Module:
    """The research model of `fields` with seeded weights (its init zeroes output projections; here every
    parameter is perturbed so that every path carries signal), its per-block checkpointing on or off."""
    sys.path.insert(0, str(research_path))
    import utils.grad_cp
    from model.rwkv7_backbone import MixerConfig, RWKV7BackboneForCausalLM

    utils.grad_cp.use_grad_cp = int(checkpointing)
    torch.manual_seed(seed)
    model = RWKV7BackboneForCausalLM(MixerConfig(**fields)).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model.train()


def our_model(fields: dict, research: torch.nn.Module) -> torch.nn.Module:
    from kvm_maglev.convert.kvm import build_model, convert_state_dict, kvm_config_from_research

    config = kvm_config_from_research({**fields, "param_dtype": "float32"})
    state = convert_state_dict({k: v.detach().clone() for k, v in research.state_dict().items()})
    return build_model(config, state).train()


def timed_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple[float, float]:
    """Seconds for one forward + backward, and the loss."""
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=labels, use_cache=False, **kwargs).loss
    loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, float(loss.detach())


def profiled_step(run) -> dict:
    """One more step under torch's profiler: seconds in the weight products (aten::mm, the same 114 calls in both
    implementations) and in everything else, as CPU self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    times = {event.key: event.self_cpu_time_total / 1e6 for event in profiler.key_averages()}
    products = times.get("aten::mm", 0.0)
    return dict(products_s=products, other_s=sum(times.values()) - products)


def bench(research_path: Path, budget: str, length: int, layers: int, repeats: int, seed: int,
          research_checkpointing: bool = False, profiled: bool = False, warmup: int = 1) -> dict:
    fields = {**RESEARCH_FIELDS, **BUDGETS[budget], "num_hidden_layers": layers}
    research = research_model(research_path, fields, seed, research_checkpointing)
    ours = our_model(fields, research)
    ids = torch.randint(0, fields["vocab_size"], (1, length + 1), generator=torch.Generator().manual_seed(seed))
    inputs = ids[:, :length]
    # the research model takes shifted targets, ours shifts its labels itself: the same targets for both
    targets = ids[:, 1:].clone()
    targets[:, -1] = -100

    runs = {"research": lambda: timed_step(research, inputs, targets), "ours": lambda: timed_step(ours, inputs, inputs)}
    times = {name: [] for name in runs}
    losses = {}
    for _ in range(warmup):
        for run in runs.values():
            run()
    for _ in range(repeats):
        for name, run in runs.items():
            seconds, losses[name] = run()
            times[name].append(seconds)
    result = dict(budget=budget, tokens=length, layers=layers, warmup=warmup,
                  research_checkpointing=research_checkpointing, seconds=times, loss=losses)
    if profiled:
        result["profile"] = {name: profiled_step(run) for name, run in runs.items()}
    for name in runs:
        if name != "research":
            ratios = [a / b for a, b in zip(times[name], times["research"])]
            result[f"{name}_over_research"] = statistics.median(ratios)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--research-path", type=Path, required=True, help="a checkout of recursal/KVM-paper")
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each implementation, interleaved")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps of each first (a process's first touch of fresh memory is slow)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--research-checkpointing", action="store_true",
                        help="keep the research code's per-block checkpointing (its training default)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each: time in the weight products against the rest")
    parser.add_argument("--out", type=Path, default=Path("results/bench_training.json"))
    args = parser.parse_args(argv)
    if not (args.research_path / "model" / "kvm_mixer.py").is_file():
        parser.error(f"--research-path {args.research_path} holds no model/kvm_mixer.py (a recursal/KVM-paper checkout)")
    results = []
    for length in args.lengths:
        for budget in args.budgets:
            result = bench(args.research_path, budget, length, args.layers, args.repeats, args.seed,
                           args.research_checkpointing, args.profile, args.warmup)
            results.append(result)
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in result.items() if k.endswith("_over_research"))
            seconds = ", ".join(f"{k} {statistics.median(v):.2f}s" for k, v in result["seconds"].items())
            print(f"{budget} {length} tokens: {seconds}; {ratios}; losses {result['loss']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m kvm_maglev.benchmarks.training", *(argv if argv is not None else sys.argv[1:])])
    args.out.write_text(json.dumps(dict(command=command, threads=torch.get_num_threads(), torch=torch.__version__,
                                        results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
