"""RULER (lm-eval 0.4.13's long-context tasks) end to end on a tiny converted folder of each model.

examples/ruler.py, the command docs/evaluation.md gives, runs one task that needs no download
(niah_single_1) at two lengths far past the model's attention window and writes its scores file;
the tests read that file. A tiny random model finds no needle: the scores' values are not the point,
their structure, the documents' lengths and the scoring of each response are.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

TASK = "niah_single_1"
LENGTHS = [512, 1024]  # max_seq_lengths: RULER's smallest haystack fits 512 of these tiny tokenizers' tokens
MAX_GEN_TOKS = 128  # niah_single_1's generation_kwargs
DOCS_PER_LENGTH = 500  # RULER makes 500 documents a length; the run scores the first of each


@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def scores_file(model_dir, tmp_path_factory):
    """`python examples/ruler.py ...` as documented, one document a length, its samples logged."""
    output = tmp_path_factory.mktemp("ruler") / "scores.json"
    example = support.load_example("ruler")
    argv = ["--model", str(model_dir), "--tasks", TASK, "--lengths", ",".join(map(str, LENGTHS)),
            "--samples-per-length", "1", "--device", "cpu", "--output", str(output), "--log-samples"]
    assert example.main(argv) == 0
    return output


@pytest.fixture(scope="module")
def report(scores_file):
    return json.loads(scores_file.read_text(encoding="utf-8"))


def attention_window(config: dict) -> int:
    """At least the most tokens any layer attends to directly (KVM: its block window, bounded by one
    chunk more than its whole chunks, and its sliding-window layers; Maglev with memory: its sliding
    window in every layer)."""
    if config["model_type"] == "kvm":
        return max(config["chunk_size"] * (config["window_chunks"] + 1), config["sliding_window"] or 0)
    assert config["use_memory"] and config["sliding_window"]
    return config["sliding_window"]


def needle_score(response: str, targets: list[str]) -> float:
    """RULER's string_match_all: the share of the needle's values found in the stripped response."""
    response = response.strip().lower()
    return sum(target.lower() in response for target in targets) / len(targets)


def test_scores_file_has_a_score_per_task_and_length(report, model_dir):
    assert report["model"] == str(model_dir)
    assert report["tasks"] == [TASK]
    assert report["max_seq_lengths"] == LENGTHS
    assert report["max_length"] == max(LENGTHS) + 256
    assert report["samples_per_length"] == {TASK: {str(length): 1 for length in LENGTHS}}
    assert set(report["scores"]) == {TASK}
    assert list(report["scores"][TASK]) == [str(length) for length in LENGTHS]
    harness = report["lm_eval"]["results"][TASK]
    for length, score in report["scores"][TASK].items():
        assert isinstance(score, float) and 0.0 <= score <= 1.0
        assert harness[f"{length},none"] == score
    assert report["lm_eval"]["n-samples"][TASK] == {"original": DOCS_PER_LENGTH * len(LENGTHS), "effective": len(LENGTHS)}


def test_documents_are_past_the_window_and_reach_the_model_whole(report, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    window = attention_window(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    samples = report["samples"][TASK]
    assert [sample["max_seq_length"] for sample in samples] == LENGTHS
    assert [sample["doc_id"] for sample in samples] == [DOCS_PER_LENGTH * i for i in range(len(LENGTHS))]
    for sample in samples:
        # RULER's own count: the prompt plus the tokens reserved for the answer, within the length
        assert 4 * window < sample["length"] <= sample["max_seq_length"]
        assert all(target in sample["prompt"] for target in sample["target"])
        # the whole prompt (with the answer prefix lm-eval appends) and the answer fit max_length: no left truncation
        prompt_tokens = len(tokenizer(sample["prompt"])["input_ids"]) + 1
        assert 4 * window < prompt_tokens and prompt_tokens + MAX_GEN_TOKS <= report["max_length"]


def test_each_score_is_the_needle_match_of_the_response(report):
    samples = report["samples"][TASK]
    for sample in samples:
        assert sample["score"] == needle_score(sample["response"], sample["target"])
    for length, score in report["scores"][TASK].items():
        of_length = [sample["score"] for sample in samples if sample["max_seq_length"] == int(length)]
        assert score == pytest.approx(sum(of_length) / len(of_length))


def test_response_is_the_models_own_greedy_generation(report, model_dir):
    """The longest document's response equals generate() on the same prompt, with the model's own cache."""
    from tests.ecosystem.test_ecosystem_lm_eval import encode_plain

    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    sample = max(report["samples"][TASK], key=lambda sample: sample["max_seq_length"])
    ids = torch.tensor([encode_plain(tokenizer, sample["prompt"])])
    with torch.no_grad():
        output = model.generate(input_ids=ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False)
    # generation stops at the model's end tokens; lm-eval decodes without the special tokens
    text = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
    assert sample["response"] == text


def test_bad_arguments_are_refused():
    example = support.load_example("ruler")
    with pytest.raises(SystemExit):
        example.parse_args(["--model", "m", "--lengths", "4096", "--max-length", "2048", "--output", "o.json"])
    args = example.parse_args(["--model", "m", "--tasks", "niah_single_1,hellaswag", "--output", "o.json"])
    with pytest.raises(ValueError, match="hellaswag"):
        example.load_tasks(args)
