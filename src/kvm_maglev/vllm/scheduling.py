"""vLLM's scheduler with what our models need of it: for Maglev folders served with `memory_prefill="prefiller"`,
a recomputed request reads its prompt first (`PromptFirstRecompute`); with prefix caching on, prompt steps stop where
a prompt stops sharing blocks with an earlier one (`SharedPrefixJunctions`).

Prompt first: a recomputed request reads its prompt first, alone in its step, so that the prefiller Q reads exactly
the prompt, as generate() does.

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

from collections import OrderedDict

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

# how the config hook names these schedulers to vLLM (`scheduler_config.scheduler_cls`, resolved by qualified name)
QUALIFIED_NAME = "kvm_maglev.vllm.scheduling.prompt_first_scheduler"
JUNCTIONS_NAME = "kvm_maglev.vllm.scheduling.shared_prefix_scheduler"
# prompt blocks `SharedPrefixJunctions` remembers (the least recently seen dropped first): two hashes each, a few
# MB; 16M prompt tokens at KVM's 256-token blocks, 1M at Maglev's 16
REMEMBERED_PROMPT_BLOCKS = 1 << 16
PARTED = object()  # what `SharedPrefixJunctions` remembers after a prefix that prompts went on from differently


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


class SharedPrefixJunctions:
    """Prompt steps that stop where prompts part, so that the state there is kept and later requests sharing that
    prefix hit it (`mamba_cache_mode="align"` keeps a state only where a step ends on a block boundary).

    vLLM finds such a junction only for hybrid models, from its attention groups' cached blocks, which an
    attention-free model has none of. This scheduler remembers, for the prompts it has looked up, which block
    follows each prefix of whole blocks (vLLM's block hashes, chained over the whole prefix, so one equal hash is an
    equal prefix); a prefix followed by two different blocks (or by one and the prompt's end) is where prompts
    part. It hands vLLM the deepest such point of a request's prompt past its cache hit as vLLM's own junction
    (`request.shared_prefix_boundary`): vLLM's split ends the prompt step there and its cache manager keeps that
    block's state. The first request to meet a junction reads it in two steps; those after it start from it. The
    hooks are vLLM 0.32's private `_get_local_prefix_cache_hit` and `shared_prefix_boundary`, checked in the
    plugin's tests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # block hash of a prompt prefix -> the hash of the block that followed it (None: the prompt's last token
        # did), or PARTED once two prompts went on differently
        self.next_blocks: OrderedDict[object, object] = OrderedDict()

    def _get_local_prefix_cache_hit(self, request: Request):
        """vLLM's cache hit, with the junction past it where the request's prompt parts from another one."""
        blocks, hit, junction, diverged = super()._get_local_prefix_cache_hit(request)
        if self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            parting = self.parting_point(request)
            if parting > hit:
                junction = max(junction, parting)
        return blocks, hit, junction, diverged

    def parting_point(self, request: Request) -> int:
        """The end of the longest prefix of whole blocks of `request`'s prompt, short of its last token (which a
        step must read for the logits), after which another prompt seen before went on differently (0: none). The
        prompt's blocks are remembered for later requests."""
        block = self.cache_config.block_size  # where vLLM's split for state models stops prompt steps
        ends = range(block, request.num_prompt_tokens, block)
        # the hash of the prompt's first `end` tokens, for each end
        hashes = [request.block_hashes[end // self.hash_block_size - 1] for end in ends]
        parting = 0
        for end, prefix, following in zip(ends, hashes, hashes[1:] + [None]):
            if self.next_blocks.setdefault(prefix, following) != following:
                self.next_blocks[prefix] = PARTED
            self.next_blocks.move_to_end(prefix)
            if self.next_blocks[prefix] is PARTED:
                parting = end
        while len(self.next_blocks) > REMEMBERED_PROMPT_BLOCKS:
            self.next_blocks.popitem(last=False)
        return parting


class SharedPrefixScheduler(SharedPrefixJunctions, Scheduler):
    """vLLM's scheduler, prompt steps stopping at shared-prefix junctions."""


class SharedPrefixAsyncScheduler(SharedPrefixJunctions, AsyncScheduler):
    """vLLM's asynchronous scheduler, prompt steps stopping at shared-prefix junctions."""


def shared_prefix_scheduler(*, vllm_config, **kwargs) -> Scheduler:
    """The engine's scheduler with prefix caching on (chosen as `prompt_first_scheduler` is)."""
    asynchronous = vllm_config.scheduler_config.async_scheduling
    scheduler = SharedPrefixAsyncScheduler if asynchronous else SharedPrefixScheduler
    return scheduler(vllm_config=vllm_config, **kwargs)
