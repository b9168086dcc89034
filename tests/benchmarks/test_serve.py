"""The serving benchmark's pure parts (no vLLM): seeded workloads, HF's static batches, the byte arithmetic, the
ratio table and the command line's defaults."""

import statistics

from kvm_maglev.benchmarks import serve


def test_workloads_are_seeded_and_within_bounds():
    for name, workload in serve.WORKLOADS.items():
        requests = serve.make_requests(workload, seed=0, vocab=4096)
        assert requests == serve.make_requests(workload, seed=0, vocab=4096)
        assert requests != serve.make_requests(workload, seed=1, vocab=4096)
        assert len(requests) == workload.requests
        for request in requests:
            assert workload.prompt[0] <= len(request.prompt) <= workload.prompt[1], name
            assert workload.output[0] <= request.max_tokens <= workload.output[1], name
            assert all(0 <= token < 4096 for token in request.prompt)
    assert [w.requests for w in serve.WORKLOADS.values()] == [32, 32, 16, 8]


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
    # every request of the long workload fits in Llama's KV budget at once
    long = serve.make_requests(serve.WORKLOADS["long"], args.seed, args.vocab)
    per_token = serve.full_attention_kv_bytes(args.layers, args.kv_heads, args.hidden // args.heads, 4, 1)
    assert serve.workload_tokens(long)["processed_tokens"] * per_token < settings["kv_cache_memory_bytes"]


def test_prefiller_engine_gets_a_budget_of_a_whole_prompt():
    """maglev-prefiller schedules prompts whole: its token budget per step is at least max_model_len, the other
    engines keep vLLM's CPU default."""
    args = serve.parse_args(["--engines", "maglev-prefiller", "maglev", "--workloads", "long-prompt"])
    assert serve.vllm_settings(args, "maglev-prefiller")["max_num_batched_tokens"] == args.max_model_len
    assert serve.vllm_settings(args, "maglev")["max_num_batched_tokens"] == 4096
    assert serve.FOLDER_OF["maglev-prefiller"] == "maglev_prefiller"
    longest = max(len(r.prompt) + r.max_tokens for r in serve.make_requests(serve.WORKLOADS["long-prompt"], 0, 4096))
    assert longest <= args.max_model_len
