"""The greedy-agreement count of `kvm_maglev.benchmarks.quantized_tokens` (its engines run in the benchmark)."""

from kvm_maglev.benchmarks.quantized_tokens import compare


def test_compare_counts_equal_continuations_and_reports_the_first_difference():
    prompts = [[1, 2, 3], [4, 5]]
    hf = [{"tokens": [7, 8, 9], "margins": [0.5, 0.25, 0.125]}, {"tokens": [1, 2, 3], "margins": [0.3, 0.02, 0.4]}]
    served = [{"tokens": [7, 8, 9], "margins": [0.5, 0.25, 0.1]}, {"tokens": [1, 6, 3], "margins": [0.3, 0.01, 0.2]}]
    result = compare(prompts, hf, served)
    assert result["equal"] == 1 and result["prompts"] == 2
    same, differs = result["per_prompt"]
    assert same == {"prompt_tokens": 3, "equal": True, "smallest_hf_margin_before": 0.125}
    assert differs == {"prompt_tokens": 2, "equal": False, "first_difference": 1, "hf_token": 2, "vllm_token": 6,
                       "hf_margin": 0.02, "vllm_margin": 0.01, "smallest_hf_margin_before": 0.3}
