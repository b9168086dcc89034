"""Benchmark decode speed, prefill time and cache size against full and sliding-window attention."""

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..models.common.transformers_versions import CACHE_NAME, returned_cache
from .models import cache_bytes, closed_form_cache_bytes


@dataclass
class Measurement:
    """Numbers for one model, batch size and context length."""

    model: str
    batch_size: int
    context: int
    prefill_s: float
    decode_ms_median: float
    decode_ms_p99: float
    decode_ms_max: float
    decode_tokens_per_s: float
    cache_bytes: int
    cache_bytes_closed_form: int | None
    step_ms: list[float] = field(default_factory=list)
    # CPU time the hypervisor took from this machine's CPUs during each step (None: not on Linux)
    step_steal_ms: list[float] | None = None
    # decoding steps ran through torch.compile (the untimed first step compiled them)
    compiled: bool = False
    # the model was stepped directly, outside its runtime_speedups() block, as a server's own loop may
    direct: bool = False
    # CPU time of this process during each step: on a shared machine, unlike wall time, it leaves out the
    # time other processes held the cores (with one thread it is the step's own compute)
    step_cpu_ms: list[float] | None = None

    @property
    def decode_ms_max_unstolen(self) -> float | None:
        """Slowest step during which the host took no CPU time (None without steal counts)."""
        if self.step_steal_ms is None:
            return None
        kept = [ms for ms, stolen in zip(self.step_ms, self.step_steal_ms) if stolen == 0]
        return max(kept) if kept else None

    @property
    def cpu_max_over_median(self) -> float | None:
        """Slowest step's CPU time over the median step's (None without CPU times)."""
        if not self.step_cpu_ms:
            return None
        return max(self.step_cpu_ms) / statistics.median(self.step_cpu_ms)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_steal_ms() -> float | None:
    """CPU time stolen by the hypervisor so far, summed over CPUs (/proc/stat); None where unavailable.

    On a virtual machine a step can stall because the host ran something else on its CPU (on this
    project's machines: after a long prompt freed memory that the guest then reported back to the host);
    the bench records it per step so such steps are told apart from the model's own slow steps."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _row_lengths(batch_size: int, context: int, generator: torch.Generator) -> list[int]:
    """Row 0 has the full context; other rows are shorter by up to a quarter (padded rows)."""
    if batch_size == 1:
        return [context]
    cuts = torch.randint(0, max(1, context // 4), (batch_size - 1,), generator=generator).tolist()
    return [context] + [context - c for c in cuts]


def _left_padded_batch(lengths: list[int], vocab: int, generator: torch.Generator, device: torch.device):
    width = max(lengths)
    ids = torch.randint(vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def _step(model, token_ids, mask, cache, use_mask: bool):
    kwargs = {"attention_mask": mask} if use_mask else {}
    out = model(input_ids=token_ids, use_cache=True, **{CACHE_NAME: cache}, **kwargs)
    return out.logits[:, -1:].argmax(-1), returned_cache(out)


@torch.inference_mode()
def measure(
    name: str,
    model: torch.nn.Module,
    context: int,
    batch_size: int,
    decode_steps: int,
    prefill_chunk: int,
    seed: int = 0,
    compile_decode: bool = False,
    direct: bool = False,
) -> Measurement:
    """Read ``context`` tokens, then time ``decode_steps`` single-token steps.

    The prompt's first ``context - 1`` tokens are the timed prefill; its last token is read by one
    untimed decoding step. Every model's first one-token step after a long prompt ran slow (one-row
    kernels and allocations after the prompt's large ones), which is not what a decoding step costs;
    the timed steps still start right at position ``context`` (a KVM chunk boundary when ``context``
    is a multiple of the chunk). Our models run inside their runtime speed-ups, as in `generate()`, or,
    with ``direct``, plainly, as a loop of one's own that never opens the block steps them.
    With ``compile_decode`` the decoding steps (not the prefill) go through `torch.compile(model)`; the
    untimed step compiles them, and a recompilation in a timed step (new shapes or code paths) is timed.
    """
    with _speedups(model, direct):
        row = _measure(name, model, context, batch_size, decode_steps, prefill_chunk, seed, compile_decode)
    row.direct = direct
    return row


def _speedups(model, direct: bool) -> contextlib.AbstractContextManager:
    """The block generate() decodes in: our models' `runtime_speedups()`, or none (baselines, `direct`)."""
    if hasattr(model, "runtime_speedups") and not direct:
        return model.runtime_speedups()
    return contextlib.nullcontext()


def _measure(name, model, context, batch_size, decode_steps, prefill_chunk, seed, compile_decode) -> Measurement:
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    lengths = _row_lengths(batch_size, context, generator)
    ids, mask = _left_padded_batch(lengths, model.config.vocab_size, generator, device)
    use_mask = batch_size > 1
    width = ids.shape[1]
    prompt = max(1, width - 1)
    if getattr(model.config, "memory_prefill", None) == "prefiller":
        prefill_chunk = prompt  # the prefiller reads the prompt in one forward (later chunks run recurrently)
    cache = None
    _sync(device)
    start = time.perf_counter()
    out = None
    for begin in range(0, prompt, prefill_chunk):
        end = min(begin + prefill_chunk, prompt)
        kwargs = {"attention_mask": mask[:, :end]} if use_mask else {}
        out = model(input_ids=ids[:, begin:end], use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache}, **kwargs)
        cache = returned_cache(out)
    _sync(device)
    prefill_s = time.perf_counter() - start
    generated = 0
    stepper = torch.compile(model) if compile_decode else model
    if prompt < width:
        next_ids, cache = _step(stepper, ids[:, prompt:], mask, cache, use_mask)
    else:  # a one-token context: the untimed step reads a generated token
        mask = torch.cat([mask, mask.new_ones(batch_size, 1)], dim=1)
        next_ids, cache = _step(stepper, out.logits[:, -1:].argmax(-1), mask, cache, use_mask)
        generated = 1
    step_ms, steal_ms, cpu_ms = [], [], []
    # only the last position's logits are kept, so no large prefill tensor is freed inside a timed step
    for _ in range(decode_steps):
        mask = torch.cat([mask, mask.new_ones(batch_size, 1)], dim=1)
        _sync(device)
        stolen = _host_steal_ms()
        cpu_start, start = time.process_time(), time.perf_counter()
        next_ids, cache = _step(stepper, next_ids, mask, cache, use_mask)
        _sync(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        cpu_ms.append((time.process_time() - cpu_start) * 1e3)
        after = _host_steal_ms()
        steal_ms.append(None if stolen is None or after is None else after - stolen)
    ordered = sorted(step_ms)
    median = statistics.median(step_ms)
    return Measurement(
        model=name,
        batch_size=batch_size,
        context=context,
        prefill_s=prefill_s,
        decode_ms_median=median,
        decode_ms_p99=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        decode_ms_max=ordered[-1],
        decode_tokens_per_s=batch_size * 1e3 / median,
        cache_bytes=cache_bytes(cache),
        cache_bytes_closed_form=closed_form_cache_bytes(model, [length + generated + decode_steps for length in lengths]),
        step_ms=step_ms,
        step_steal_ms=None if None in steal_ms else steal_ms,
        compiled=compile_decode,
        step_cpu_ms=cpu_ms,
    )
