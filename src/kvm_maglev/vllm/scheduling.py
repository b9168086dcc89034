"""vLLM's scheduler for Maglev folders served with `memory_prefill="prefiller"`: a recomputed request reads its
prompt first, alone in its step, so that the prefiller Q reads exactly the prompt, as generate() does.

After a preemption vLLM recomputes a request from position 0 over its prompt and the tokens it generated, all of
them as one prompt. generate() read those tokens differently: Q read the prompt in parallel, P continued over the
generated tokens with its own memories. This scheduler ends a recomputed request's first step at its prompt (the
scheduler knows every request's prompt length); the generated tokens follow in the next step, at positions past
the prompt, which the served model reads recurrently. vLLM discards the token sampled at the end of that prompt-only
step, as it does after any partial prefill.

The per-request cap is vLLM 0.32's split hook for recurrent-state prefills (`_mamba_block_aligned_split`, called for
every scheduled request when `need_mamba_block_aligned_split` is set; private API, checked in the plugin's tests).
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

# how the config hook names this scheduler to vLLM (`scheduler_config.scheduler_cls`, resolved by qualified name)
QUALIFIED_NAME = "kvm_maglev.vllm.scheduling.prompt_first_scheduler"


class PromptFirstRecompute:
    """Ends the first step of a request that starts at position 0 at its prompt: a new request's whole prompt
    (unchanged: chunked prefill is off) or the prompt part of a recomputed one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM applies the split hook below to every request it schedules only when this is set
        self.need_mamba_block_aligned_split = True

    def _mamba_block_aligned_split(self, request: Request, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        """The tokens `request` reads this step: at most its prompt when it reads from position 0."""
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start == 0:
            return min(num_new_tokens, request.num_prompt_tokens)
        return num_new_tokens


class PromptFirstScheduler(PromptFirstRecompute, Scheduler):
    """vLLM's scheduler, recomputed requests reading their prompt first."""


class PromptFirstAsyncScheduler(PromptFirstRecompute, AsyncScheduler):
    """vLLM's asynchronous scheduler, recomputed requests reading their prompt first."""


def prompt_first_scheduler(*, vllm_config, **kwargs) -> Scheduler:
    """The engine's scheduler, chosen when the engine makes it: vLLM settles `async_scheduling` after the model's
    config hook has named this factory, so the asynchronous variant is picked here."""
    asynchronous = vllm_config.scheduler_config.async_scheduling
    scheduler = PromptFirstAsyncScheduler if asynchronous else PromptFirstScheduler
    return scheduler(vllm_config=vllm_config, **kwargs)
