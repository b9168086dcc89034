"""KVM and Maglev on vLLM split over two tensor-parallel ranks: the same greedy tokens as one rank and as generate()
(chunked prefill, requests at several positions; Maglev also preempted, and its prefiller), about half the weights
and pages per rank, and the sizes that cannot be split refused at start-up. On CPU each rank is one process bound
to one core (VLLM_CPU_OMP_THREADS_BIND="0|1")."""

from __future__ import annotations

import contextlib
import os
from math import prod

import pytest
import torch

from tests.vllm.folders import make_kvm_folder, make_maglev_folder
from tests.vllm.test_vllm_serving import (
    ENGINE,
    MODELS,
    NEW_TOKENS,
    greedy,
    hf_continuation,
    hf_model,
    junction_prompts,
    one_at_a_time,
    prompts,
    run_schedule,
    split_prompts,
)

# two-rank engines one at a time, on one xdist worker (CI runs tests/vllm on two)
pytestmark = pytest.mark.xdist_group("two_ranks")

# vLLM's worker RPCs take a callable only with this set (the callables below are the test's own)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

TP_ENGINE = dict(ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 24)


def two_ranks_unavailable() -> str | None:
    """Why two tensor-parallel ranks cannot start here, or None when they can."""
    from vllm.platforms import current_platform

    if not torch.distributed.is_available():
        return "torch is built without torch.distributed"
    if current_platform.is_cpu():
        if len(os.sched_getaffinity(0)) < 2:
            return "two CPU ranks need two cores (one bound to each rank)"
        return None
    if torch.accelerator.device_count() < 2:
        return f"two ranks need two {current_platform.device_name} devices, this machine has fewer"
    return None


needs_two_ranks = pytest.mark.skipif(two_ranks_unavailable() is not None,
                                     reason=f"tensor parallelism: {two_ranks_unavailable()}")


@contextlib.contextmanager
def rank_binding(tp_size: int):
    """On CPU, one core per rank while the engine starts (its worker processes read the binding when they start).
    An engine core started in this process freezes vLLM's view of the environment (`enable_envs_cache`), so the
    cache is dropped around the start: else an engine made after another would keep the first one's binding."""
    from vllm.envs import disable_envs_cache
    from vllm.platforms import current_platform

    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if current_platform.is_cpu() and tp_size > 1:
        cores = sorted(os.sched_getaffinity(0))[:tp_size]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in cores)
    disable_envs_cache()
    try:
        yield
    finally:
        disable_envs_cache()
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    """KVM with a growing power-law state and grouped-query heads (4 query heads, 2 key/value heads): each of two
    ranks holds 2 query heads and the key/value head they read."""
    return make_kvm_folder(tmp_path_factory.mktemp("kvm_tp"), "power_law", num_attention_heads=4,
                           num_key_value_heads=2)


def engines_of(folder):
    """A function giving the folder served at a tensor-parallel size (made once each, on first use), and the dict
    that holds them."""
    from vllm import LLM

    made = {}

    def engine(tp_size: int):
        if tp_size not in made:
            with rank_binding(tp_size):
                made[tp_size] = LLM(model=str(folder), **TP_ENGINE, tensor_parallel_size=tp_size)
        return made[tp_size]
    return engine, made


@pytest.fixture(scope="module")
def engines(gqa_folder):
    """The KVM folder served at tensor_parallel_size 1 and 2."""
    engine, made = engines_of(gqa_folder)
    yield engine
    made.clear()


@pytest.fixture(scope="module")
def maglev_folder(tmp_path_factory):
    """Maglev (window 8, 3 layers, 4 query / 2 key-value heads, value embeddings, smear, backout, soft cap) as the
    serving tests make it: each of two ranks holds 2 query heads, their key/value head and its memory projections."""
    return MODELS["maglev"](tmp_path_factory.mktemp("maglev_tp"))


@pytest.fixture(scope="module")
def maglev_engines(maglev_folder):
    """The Maglev folder served at tensor_parallel_size 1 and 2."""
    engine, made = engines_of(maglev_folder)
    yield engine
    made.clear()


def greedy_tokens(llm, batch: list[list[int]]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids)
            for output in llm.generate([{"prompt_token_ids": prompt} for prompt in batch], greedy())]


def shared_prefixes_at_two_ranks(engine, folder) -> None:
    """Prefix caching at two ranks (each copies its own share of a cached state): requests sharing a 3-block prefix
    read in 16-token steps hit where the prompts part, as at one rank, and every request's tokens equal one rank's
    and generate()'s."""
    batch = junction_prompts()
    two, two_hits = one_at_a_time(engine(2), batch)
    one, one_hits = one_at_a_time(engine(1), batch)
    assert two_hits == one_hits == [0, 0, 24, 24], (two_hits, one_hits)
    model = hf_model(folder)
    for prompt, tokens_two, tokens_one in zip(batch, two, one):
        assert tokens_two == tokens_one == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"


@needs_two_ranks
def test_two_ranks_give_one_ranks_and_generates_tokens(gqa_folder, engines):
    """Prompts of 1 to 40 tokens read in 16-token steps (chunked prefill, state folds, window wrap-around)."""
    batch = prompts(seed=4)
    two = greedy_tokens(engines(2), batch)
    one = greedy_tokens(engines(1), batch)
    model = hf_model(gqa_folder)
    for prompt, tokens_two, tokens_one in zip(batch, two, one):
        assert tokens_two == tokens_one == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"


# placed right after the tests that make the engines they share: run before an engine was made and deleted in this
# process (the next test), a one-rank engine made here failed its later steps with "pipeline model parallel group is
# not initialized" (vLLM's process-wide groups, taken down with the deleted engine, it seems; not traced further)
@needs_two_ranks
def test_two_ranks_cache_shared_prefixes_and_give_generates_tokens(gqa_folder, engines):
    """KVM: see `shared_prefixes_at_two_ranks`."""
    shared_prefixes_at_two_ranks(engines, gqa_folder)


@needs_two_ranks
def test_two_ranks_split_sliding_layers_soft_cap_and_the_post_token_shift_gate(tmp_path):
    """Sliding-window layers beside saturating-state KVM layers, the post-token-shift value gate (each rank mixes
    the whole input with all of `v_shift`, gathered from its shards), block lambdas and a logit soft cap (applied
    by vLLM's logits processor after the ranks' logits are gathered): generate()'s tokens."""
    from vllm import LLM

    folder = make_kvm_folder(tmp_path / "kvm", "saturation_swa_post_tokenshift")
    batch = prompts(seed=5)
    with rank_binding(2):
        llm = LLM(model=str(folder), **TP_ENGINE, tensor_parallel_size=2)
    model = hf_model(folder)
    for prompt, tokens in zip(batch, greedy_tokens(llm, batch)):
        assert tokens == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"
    del llm


def held_bytes(worker) -> tuple[int, int]:
    """A rank's weight bytes (each parameter once, its own share) and one request's page bytes over its layers."""
    from kvm_maglev.models.common.tensor_parallel import local_tensor

    model = worker.model_runner.model
    weights = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    pages = sum(prod(shape) * torch.empty((), dtype=dtype).element_size() for layer in model.state_layers
                for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype()))
    return weights, pages


def assert_each_rank_holds_about_half(engines) -> None:
    (weights_one, pages_one), = engines(1).collective_rpc(held_bytes)
    ranks = engines(2).collective_rpc(held_bytes)
    assert len(ranks) == 2
    for weights, pages in ranks:
        assert weights <= 0.55 * weights_one, (weights, weights_one)
        assert pages <= 0.55 * pages_one, (pages, pages_one)


@needs_two_ranks
def test_each_rank_holds_about_half_the_weights_and_pages(engines):
    """Heads, MLP units and vocabulary are split; what stays replicated (layer norms, the value gate's down
    projection, the vocabulary's padding) keeps a rank's share a little above half."""
    assert_each_rank_holds_about_half(engines)


@needs_two_ranks
def test_maglev_each_rank_holds_about_half_the_weights_and_pages(maglev_engines):
    """Maglev: heads with their memory projections and gates, value-embedding columns, MLP units and vocabulary are
    split, and the carry by channel; its lambdas, smear gate and memory_init stay whole."""
    assert_each_rank_holds_about_half(maglev_engines)


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (3, 3)])
def test_sizes_two_ranks_cannot_split_are_refused(heads, kv_heads, tmp_path):
    """Refused while the config is checked, before any rank starts, naming the sizes that do not divide."""
    from vllm import LLM

    folder = make_kvm_folder(tmp_path / "kvm", "power_law", num_attention_heads=heads, num_key_value_heads=kv_heads,
                             hidden_size=48)
    with pytest.raises(Exception, match=rf"tensor_parallel_size=2 does not divide .*num_key_value_heads={kv_heads}"):
        LLM(model=str(folder), **TP_ENGINE, tensor_parallel_size=2)


def test_maglev_sizes_two_ranks_cannot_split_are_refused(tmp_path):
    """One key/value head (its ring, memory projections and gate cannot be halved): refused before any rank starts."""
    from vllm import LLM

    folder = make_maglev_folder(tmp_path / "maglev", num_key_value_heads=1)
    with pytest.raises(Exception, match=r"MaglevForCausalLM: tensor_parallel_size=2 does not divide "
                                        r"num_key_value_heads=1"):
        LLM(model=str(folder), **TP_ENGINE, tensor_parallel_size=2)


def test_pipeline_parallelism_is_refused(tmp_path):
    from vllm import LLM

    kvm = make_kvm_folder(tmp_path / "kvm", "power_law")
    with pytest.raises(Exception, match="Pipeline parallelism is not supported for this model"):
        LLM(model=str(kvm), **TP_ENGINE, pipeline_parallel_size=2)


def test_the_plan_decides_each_split():
    """The served split is read from KVM's transformers plan: colwise in, rowwise out, per-head parameters sharded,
    what the plan leaves out replicated, and a style the plugin does not know refused."""
    from kvm_maglev import KVMConfig
    from kvm_maglev.vllm.tensor_parallel import plan_rule

    plan = KVMConfig().base_model_tp_plan
    assert plan_rule(plan, "layers.3.self_attn.q_proj") == "colwise"
    assert plan_rule(plan, "layers.0.self_attn.merge_gate_proj") == "colwise"
    assert plan_rule(plan, "layers.12.self_attn.o_proj") == "rowwise"
    assert plan_rule(plan, "layers.1.mlp.down_proj") == "rowwise"
    assert plan_rule(plan, "layers.1.self_attn.v_shift") == "colwise"
    for replicated in ("layers.0.self_attn.value_gate_down", "layers.0.input_layernorm", "layers.0.self_attn.q_norm",
                       "embed_tokens", "self_attn.q_proj", "layers.0.self_attn.q_proj.extra"):
        assert plan_rule(plan, replicated) is None, replicated
    with pytest.raises(ValueError, match="'sequence_parallel' is not a split"):
        plan_rule({"layers.*.mlp.up_proj": "sequence_parallel"}, "layers.0.mlp.up_proj")


def test_maglevs_plan_splits_the_memory_with_its_key_value_heads():
    """Maglev's memory projections and gates follow the key/value heads they feed; a separate prefiller's blocks
    split as P's; the memory's own projections (hidden to hidden) stay whole."""
    from kvm_maglev import MaglevConfig
    from kvm_maglev.vllm.tensor_parallel import plan_rule

    plan = MaglevConfig(has_prefiller=True, prefiller_shares_blocks=False, memory_projection=True).base_model_tp_plan
    for name in ("memory_k_proj", "memory_v_proj", "memory_gate", "value_gate", "k_proj"):
        assert plan_rule(plan, f"layers.2.self_attn.{name}") == "colwise", name
    assert plan_rule(plan, "prefiller_layers.1.self_attn.q_proj") == "colwise"
    assert plan_rule(plan, "prefiller_layers.1.mlp.down_proj") == "rowwise"
    for replicated in ("memory_proj", "smear_gate", "memory_init", "value_embeddings.1"):
        assert plan_rule(plan, replicated) is None, replicated


@needs_two_ranks
def test_maglev_two_ranks_give_one_ranks_and_generates_tokens_chunked_and_preempted(maglev_folder, maglev_engines):
    """Prompts of 1 to 40 tokens read recurrently in 16-token steps, every running request preempted twice (steps 6
    and 14, some mid-prompt, some decoding): at both sizes the tokens of one uninterrupted generate()."""
    batch = prompts(seed=6)
    requests = [(0, prompt, NEW_TOKENS) for prompt in batch]
    two = run_schedule(maglev_engines(2).llm_engine, requests, {6, 14}, "two")
    one = run_schedule(maglev_engines(1).llm_engine, requests, {6, 14}, "one")
    model = hf_model(maglev_folder)
    for index, prompt in enumerate(batch):
        assert two[index] == one[index] == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"


@needs_two_ranks
def test_maglev_two_ranks_cache_shared_prefixes_and_give_generates_tokens(maglev_folder, maglev_engines):
    """Maglev: see `shared_prefixes_at_two_ranks` (placed before the test below, which deletes an engine)."""
    shared_prefixes_at_two_ranks(maglev_engines, maglev_folder)


@needs_two_ranks
def test_maglev_prefiller_two_ranks_give_generates_tokens(tmp_path):
    """A Maglev folder with a prefiller Q of its own (split as P), `memory_prefill="prefiller"`: prompts scheduled
    whole, requests arriving while others decode, every running request preempted twice."""
    from vllm import LLM

    folder = MODELS["maglev_prefiller"](tmp_path / "maglev_prefiller")
    batch = prompts(seed=7)
    requests = [(2 * index, prompt, NEW_TOKENS) for index, prompt in enumerate(batch)]
    arguments = dict(ENGINE, kv_cache_memory_bytes=TP_ENGINE["kv_cache_memory_bytes"]) | split_prompts(folder, 16)
    with rank_binding(2):
        llm = LLM(model=str(folder), **arguments, tensor_parallel_size=2)
    tokens = run_schedule(llm.llm_engine, requests, {5, 12}, "prefiller")
    model = hf_model(folder)
    for index, prompt in enumerate(batch):
        assert tokens[index] == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"
    del llm


@needs_two_ranks
def test_two_ranks_compiled_give_generates_tokens(tmp_path):
    """At vLLM's default of compiling the model: each rank's forward traced whole and split at the state operators,
    its shares of the heads inside them (rotary on half of each head, so that state keys differ and merges are no
    ties for rounding to break)."""
    from vllm import LLM

    folder = make_kvm_folder(tmp_path / "kvm", "power_law", num_attention_heads=4, num_key_value_heads=2,
                             rotary_dim=4)
    batch = prompts(seed=4)
    with rank_binding(2):
        llm = LLM(model=str(folder), **(TP_ENGINE | dict(enforce_eager=False)), tensor_parallel_size=2)
    model = hf_model(folder)
    for prompt, tokens in zip(batch, greedy_tokens(llm, batch)):
        assert tokens == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"
    del llm
