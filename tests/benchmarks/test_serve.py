"""The serving benchmark's pure parts (no vLLM): seeded workloads, HF's static batches, the byte arithmetic, the
ratio table and the command line's defaults."""

import statistics

from kvm_maglev.benchmarks import serve
from kvm_maglev.models.kvm.state_kvm import state_slots_after


def test_workloads_are_seeded_and_within_bounds():
    for name, workload in serve.WORKLOADS.items():
        requests = serve.make_requests(workload, seed=0, vocab=4096)
        assert requests == serve.make_requests(workload, seed=0, vocab=4096)
        assert requests != serve.make_requests(workload, seed=1, vocab=4096)
        assert len(requests) == workload.requests
        for request in requests:
            own = len(request.prompt) - workload.shared_prefix
            assert workload.prompt[0] <= own <= workload.prompt[1], name
            assert workload.output[0] <= request.max_tokens <= workload.output[1], name
            assert all(0 <= token < 4096 for token in request.prompt)
    assert [w.requests for w in serve.WORKLOADS.values()] == [32, 32, 16, 8, 32]


def test_chat_requests_share_one_system_prompt_and_differ_after_it():
    """chat: 32 requests whose prompts start with the same 1,024 tokens, each with its own 16-256 after them."""
    chat = serve.WORKLOADS["chat"]
    assert (chat.requests, chat.shared_prefix, chat.prompt, chat.output) == (32, 1024, (16, 256), (32, 128))
    requests = serve.make_requests(chat, seed=0, vocab=4096)
    system = requests[0].prompt[:1024]
    assert all(r.prompt[:1024] == system for r in requests)
    own = [tuple(r.prompt[1024:]) for r in requests]
    assert len(set(own)) == 32 and len({len(part) for part in own}) > 8
    # the workloads without a system prompt draw what they drew before it existed
    assert serve.make_requests(serve.WORKLOADS["mixed"], 0, 4096) == serve.make_requests(
        serve.Workload("mixed", 32, (16, 1024), (16, 96), "log-uniform"), 0, 4096)


def test_log_uniform_prompts_center_on_the_geometric_mean():
    wide = serve.Workload("wide", 2000, (16, 1024), (1, 1), "log-uniform")
    lengths = [len(r.prompt) for r in serve.make_requests(wide, seed=0, vocab=8)]
    assert min(lengths) >= 16 and max(lengths) <= 1024
    assert 100 < statistics.median(lengths) < 165  # sqrt(16 * 1024) = 128; uniform would give 520
    flat = serve.Workload("flat", 2000, (16, 1024), (1, 1))
    assert 450 < statistics.median(len(r.prompt) for r in serve.make_requests(flat, seed=0, vocab=8)) < 590


def test_static_batches_keep_submission_order_and_count_padding_steps():
    requests = [serve.Request([1] * n, out) for n, out in [(3, 5), (1, 9), (2, 2), (4, 4), (5, 1)]]
    batches = serve.static_batches(requests, 2)
    assert [[len(r.prompt) for r in b] for b in batches] == [[3, 1], [2, 4], [5]]
    assert serve.hf_generated_tokens(requests, 2) == 2 * 9 + 2 * 4 + 1 * 1
    tokens = serve.workload_tokens(requests)
    assert tokens == {"prompt_tokens": 15, "output_tokens": 21, "processed_tokens": 36}
    assert serve.rates(requests, 2.0) == {"output_tokens_per_s": 10.5, "processed_tokens_per_s": 18.0}


def test_byte_arithmetic():
    # Llama of the benchmark's shape at 32k tokens: 2 (K, V) * 4 layers * 2 heads * 64 channels * 4 bytes * 32768
    assert serve.full_attention_kv_bytes(4, 2, 64, 4, 32768) == 128 * 2 ** 20
    assert serve.padded_page_bytes([10, 30, 20]) == 90
    chunks = serve.power_law_max_chunks(16.0, 0.5, 256, 32768)
    assert chunks == 12 and 16 * 32768 ** 0.5 <= chunks * 256


def test_kvm_config_keywords():
    args = serve.parse_args(["--kvm-budget", "power_law"])
    kwargs = serve.kvm_config_kwargs(args)
    assert kwargs["state_budget_mode"] == "power_law" and kwargs["state_budget_factor"] == 16.0
    # the cap (chunks of 256, KVMConfig's default chunk) above the budget at max_model_len: the state grows to the end
    assert kwargs["state_max_chunks"] * 256 > 16.0 * args.max_model_len ** 0.5
    assert serve.kvm_config_kwargs(serve.parse_args([])) == serve.shape_kwargs(serve.parse_args([]))


def test_the_120m_shape_is_the_papers_released_kvm():
    """`--shape 120M`: kvmpaper_kvmsqrt16_120M (hidden 768, 12 layers, 6 heads, vocabulary 50,304, chunks of 256, a
    512-token window, 16 sqrt(n) slots), Maglev's and Mistral's window 512; a field given on the command line wins."""
    from kvm_maglev import KVMConfig, MaglevConfig

    args = serve.parse_args(["--shape", "120M"])
    config = KVMConfig(**serve.kvm_config_kwargs(args))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.vocab_size) == (
        768, 12, 6, 50304)
    assert (config.chunk_size, config.window_size, config.state_budget_mode) == (256, 512, "power_law")
    assert (config.state_budget_factor, config.state_budget_exponent, config.state_budget_min) == (16.0, 0.5, 256)
    # about 16 sqrt(n) slots at 64k tokens (n: the tokens folded, all but the window's): far from the cap
    assert 16 * 250 <= state_slots_after(config, 1 << 16) <= 16 * 256
    assert args.window == 512 and args.max_model_len == 2048
    assert MaglevConfig(**serve.shape_kwargs(args), sliding_window=args.window).head_dim == 128
    assert serve.parse_args(["--shape", "120M", "--layers", "2", "--window", "256"]).layers == 2
    small = serve.parse_args([])
    assert (small.hidden, small.layers, small.heads, small.kv_heads, small.vocab, small.window, small.kvm_budget) == (
        256, 4, 4, 2, 4096, 128, "fixed")


def test_requests_option_takes_the_first_requests():
    args = serve.parse_args(["--requests", "3"])
    assert args.requests == 3
    full = serve.make_requests(serve.WORKLOADS["chat"], 0, 4096)
    assert full[:args.requests] == full[:3] and len(full[:None]) == 32


def test_ratio_table_reads_output_rates_and_skips_missing_sides():
    results = {"mixed": {"kvm": {"output_tokens_per_s": 300.0}, "llama": {"output_tokens_per_s": 100.0},
                         "hf-kvm": {"skipped": "--skip-hf-long"}, "maglev": {"output_tokens_per_s": 50.0}}}
    assert serve.ratio_table(results) == {"mixed": {"kvm/llama": 3.0, "maglev/llama": 0.5}}


def test_defaults_run_everything_at_32k():
    args = serve.parse_args([])
    assert args.workloads == ["mixed", "decode-heavy", "long"]
    assert set(args.engines) == {"kvm", "maglev", "llama", "mistral", "hf-kvm", "hf-maglev"}
    settings = serve.vllm_settings(args)
    assert settings["max_model_len"] == 32768 and settings["max_num_seqs"] == 32
    assert not settings["enforce_eager"]  # vLLM's default: the models compiled
    assert serve.vllm_settings(serve.parse_args(["--enforce-eager"]))["enforce_eager"]
    # vLLM's defaults of prefix caching and token budget, unless asked otherwise
    assert "enable_prefix_caching" not in settings and "max_num_batched_tokens" not in settings
    assert serve.vllm_settings(serve.parse_args(["--no-prefix-caching"]))["enable_prefix_caching"] is False
    # every request of the long workload fits in Llama's KV budget at once
    long = serve.make_requests(serve.WORKLOADS["long"], args.seed, args.vocab)
    per_token = serve.full_attention_kv_bytes(args.layers, args.kv_heads, args.hidden // args.heads, 4, 1)
    assert serve.workload_tokens(long)["processed_tokens"] * per_token < settings["kv_cache_memory_bytes"]


def test_prefiller_engine_gets_a_budget_of_a_whole_prompt():
    """maglev-prefiller schedules prompts whole: at vLLM's defaults the plugin sets its token budget per step to
    max_model_len, so nothing is passed; a budget given on the command line is at least max_model_len for it, the
    other engines get the given one."""
    args = serve.parse_args(["--engines", "maglev-prefiller", "maglev", "--workloads", "long-prompt"])
    assert "max_num_batched_tokens" not in serve.vllm_settings(args, "maglev-prefiller")
    args = serve.parse_args(["--engines", "maglev-prefiller", "maglev", "--max-num-batched-tokens", "4096"])
    assert serve.vllm_settings(args, "maglev-prefiller")["max_num_batched_tokens"] == args.max_model_len
    assert serve.vllm_settings(args, "maglev")["max_num_batched_tokens"] == 4096
    assert serve.FOLDER_OF["maglev-prefiller"] == "maglev_prefiller"
    longest = max(len(r.prompt) + r.max_tokens for r in serve.make_requests(serve.WORKLOADS["long-prompt"], 0, 4096))
    assert longest <= args.max_model_len


def test_aten_counts_of_a_profiled_region():
    """serve_profile's counts: the aten calls under a profiler range, outermost (what the code dispatched), leaves
    (no aten call below them) and all, against what the region runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvm_maglev.benchmarks.serve_profile import aten_counts, descendants

    x = torch.randn(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("region"):
            torch.nn.functional.linear(x, x).relu()
        x.add(1)
    events = list(prof.events())
    region = aten_counts(descendants(next(event for event in events if event.name == "region")))
    assert region["outermost_aten_calls"] == 2 and set(region["most_frequent_outermost"]) == {"aten::linear",
                                                                                              "aten::relu"}
    assert region["aten_events"] > region["leaf_aten_calls"] >= 2  # linear dispatches its own aten calls
    assert aten_counts(events)["outermost_aten_calls"] == 3
