"""The speed and memory targets of the benchmark issue, checked on one run's measurements.

Each check is a ratio read off the run; a check whose rows were not measured (other models or
contexts were asked for) is left out rather than guessed.
"""

from collections.abc import Callable
from dataclasses import dataclass

from .decode import Measurement

KVM_MODELS = ("kvm_fixed", "kvm_sqrt16")
BATCHED_MODELS = ("kvm_fixed", "kvm_sqrt16", "maglev")


@dataclass
class TargetCheck:
    """One target: what was compared, the measured ratio and the bound it must meet."""

    target: str
    value: float
    bound: float
    at_most: bool  # True: value <= bound passes; False: value >= bound passes

    @property
    def met(self) -> bool:
        return self.value <= self.bound if self.at_most else self.value >= self.bound


def _row(results: list[Measurement], model: str, batch: int, context: int) -> Measurement | None:
    return next((r for r in results if (r.model, r.batch_size, r.context) == (model, batch, context)), None)


def _ratio(
    checks: list[TargetCheck], text: str, numerator: Measurement | None, denominator: Measurement | None,
    field: Callable[[Measurement], float], bound: float, at_most: bool = True,
) -> None:
    if numerator is not None and denominator is not None and field(denominator) > 0:
        checks.append(TargetCheck(text, field(numerator) / field(denominator), bound, at_most))


def check_targets(results: list[Measurement]) -> list[TargetCheck]:
    """Every target the run has the rows for (decode times are medians, batch 1 unless stated)."""
    checks: list[TargetCheck] = []
    contexts = sorted({r.context for r in results if r.context > 1})
    if not contexts:
        return checks
    small, large = contexts[0], contexts[-1]
    decode = lambda r: r.decode_ms_median  # noqa: E731 - field readers
    prefill = lambda r: r.prefill_s  # noqa: E731
    size = lambda r: r.cache_bytes  # noqa: E731

    _ratio(checks, f"kvm_fixed decode after {large} / after {small} <= 1.05",
           _row(results, "kvm_fixed", 1, large), _row(results, "kvm_fixed", 1, small), decode, 1.05)
    _ratio(checks, f"kvm_sqrt16 decode after {large} / llama_full after 8192 < 1",
           _row(results, "kvm_sqrt16", 1, large), _row(results, "llama_full", 1, 8192), decode, 1.0)
    for r in results:
        if r.model in KVM_MODELS and r.context > 1:
            checks.append(TargetCheck(f"{r.model} b{r.batch_size} ctx {r.context}: slowest step / median <= 1.5",
                                      r.decode_ms_max / r.decode_ms_median, 1.5, True))
            if r.cpu_max_over_median is not None:
                checks.append(TargetCheck(
                    f"{r.model} b{r.batch_size} ctx {r.context}: slowest step's CPU time / median's <= 1.5",
                    r.cpu_max_over_median, 1.5, True))
            unstolen = r.decode_ms_max_unstolen
            if unstolen is not None and unstolen < r.decode_ms_max:
                checks.append(TargetCheck(
                    f"{r.model} b{r.batch_size} ctx {r.context}: slowest step the host took no CPU from / median <= 1.5",
                    unstolen / r.decode_ms_median, 1.5, True))
    batched = sorted({r.batch_size for r in results if r.batch_size > 1})
    for model in BATCHED_MODELS:
        for batch in batched:
            for context in contexts:
                many, one = _row(results, model, batch, context), _row(results, model, 1, context)
                if many is not None and one is not None:
                    checks.append(TargetCheck(
                        f"{model} ctx {context}: batch {batch} tokens/s / batch 1 >= 4",
                        many.decode_tokens_per_s / one.decode_tokens_per_s, 4.0, False))
    _ratio(checks, f"maglev decode after {large} / after {small} <= 1.1",
           _row(results, "maglev", 1, large), _row(results, "maglev", 1, small), decode, 1.1)
    for context in contexts:
        _ratio(checks, f"maglev / mistral_swa decode after {context} <= 1.15",
               _row(results, "maglev", 1, context), _row(results, "mistral_swa", 1, context), decode, 1.15)
    _ratio(checks, "maglev recurrent prompt / prefiller prompt at 4096 >= 10",
           _row(results, "maglev", 1, 4096), _row(results, "maglev_prefiller", 1, 4096), prefill, 10.0, at_most=False)
    _ratio(checks, f"kvm_sqrt16 cache / llama_full cache after {large} <= 1/8",
           _row(results, "kvm_sqrt16", 1, large), _row(results, "llama_full", 1, large), size, 0.125)
    window_rows = [r for r in results if r.model == "maglev" and r.batch_size == 1 and r.context > 1]
    if len(window_rows) > 1:
        sizes = [r.cache_bytes for r in window_rows]
        checks.append(TargetCheck("maglev cache largest / smallest over contexts == 1", max(sizes) / min(sizes), 1.0, True))
    for model in KVM_MODELS:
        _ratio(checks, f"{model} prefill / llama_full prefill at {large} < 1",
               _row(results, model, 1, large), _row(results, "llama_full", 1, large), prefill, 1.0)
    return checks


def format_checks(checks: list[TargetCheck]) -> str:
    return "\n".join(f"{'met ' if c.met else 'MISS'}  {c.value:8.3f}  {c.target}" for c in checks)
