"""lm-evaluation-harness (HFLM, trust_remote_code) on the repo's local tasks, against a direct computation."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

TASKS = "lighthouse_choice,lighthouse_answer"
DOCS_PER_TASK = 2
@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


def run_example(model_dir, output, batch_size=1, tasks=TASKS):
    """examples/evaluate.py on the local tasks; returns (HFLM, per-task samples, results)."""
    example = support.load_example("evaluate")
    args = example.parse_args(["--model", str(model_dir), "--tasks", tasks, "--limit", str(DOCS_PER_TASK),
                               "--batch-size", str(batch_size), "--output", str(output)])
    lm = example.load_model(args)
    results = example.evaluate(args, lm)
    return lm, results["samples"], results["results"]


@pytest.fixture(scope="module")
def unbatched(model_dir, tmp_path_factory):
    return run_example(model_dir, tmp_path_factory.mktemp("lm_eval") / "results.json")


def prompt_prefix(tokenizer) -> list[int]:
    """What a prompt starts with: <|bos|> for nanochat (its encode(text, prepend=bos)), nothing for GPT-2."""
    return [tokenizer.convert_tokens_to_ids("<|bos|>")] if "<|bos|>" in tokenizer.get_vocab() else []


def encode_plain(tokenizer, text: str) -> list[int]:
    return prompt_prefix(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Split as lm-eval does: trailing spaces of the context move to the continuation, and the
    continuation's tokens are those of the whole string after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode_plain(tokenizer, context + continuation)
    context_ids = encode_plain(tokenizer, context)
    return context_ids, whole[len(context_ids):]


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), dim=-1)[0, -len(continuation_ids):]
    targets = torch.tensor(continuation_ids)
    total = logprobs.gather(-1, targets[:, None]).sum().item()
    return total, bool(torch.equal(logprobs.argmax(-1), targets))


def direct_generation(model, tokenizer, context: str, until: list[str], max_new_tokens: int) -> str:
    ids = torch.tensor([encode_plain(tokenizer, context)])
    output = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
    text = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=False)
    for stop in until:
        text = text.split(stop)[0]
    return text


def test_max_length_comes_from_the_config(model_dir, unbatched):
    lm, _, _ = unbatched
    config = json.loads((model_dir / "config.json").read_text())
    assert lm.max_length == config["max_position_embeddings"]


def test_loglikelihood_scores_equal_a_direct_computation(model_dir, unbatched):
    _, samples, results = unbatched
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    choice_samples = samples["lighthouse_choice"]
    assert len(choice_samples) == DOCS_PER_TASK
    correct = []
    for sample in choice_samples:
        direct = [direct_loglikelihood(model, tokenizer, context, continuation)
                  for context, continuation in sample["arguments"]]
        harness = [tuple(response[0]) for response in sample["resps"]]
        for (ll, greedy), (harness_ll, harness_greedy) in zip(direct, harness, strict=True):
            assert harness_ll == pytest.approx(ll, abs=1e-4)
            assert harness_greedy == greedy
        correct.append(float(max(range(len(direct)), key=lambda i: direct[i][0]) == sample["target"]))
        assert sample["acc"] == correct[-1]
    assert results["lighthouse_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_generate_until_equals_direct_greedy_generation(model_dir, unbatched):
    _, samples, _ = unbatched
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    answer_samples = samples["lighthouse_answer"]
    assert len(answer_samples) == DOCS_PER_TASK
    for sample in answer_samples:
        context, settings = sample["arguments"][0]
        expected = direct_generation(model, tokenizer, context, settings["until"], settings["max_gen_toks"])
        assert sample["resps"][0][0] == expected


@pytest.fixture(scope="module")
def batched(model_dir, tmp_path_factory):
    """The same tasks with batches of 2: log-likelihood batches are right-padded and run without
    an attention mask, generation batches are left-padded with one."""
    return run_example(model_dir, tmp_path_factory.mktemp("lm_eval_batched") / "results.json", batch_size=2)


def test_batched_loglikelihood_equals_unbatched(unbatched, batched):
    for one, many in zip(unbatched[1]["lighthouse_choice"], batched[1]["lighthouse_choice"], strict=True):
        for (ll, greedy), (batched_ll, batched_greedy) in zip([r[0] for r in one["resps"]],
                                                              [r[0] for r in many["resps"]], strict=True):
            assert batched_ll == pytest.approx(ll, abs=1e-4) and batched_greedy == greedy


def test_batched_generate_until_equals_unbatched(unbatched, batched):
    assert ([s["resps"] for s in batched[1]["lighthouse_answer"]]
            == [s["resps"] for s in unbatched[1]["lighthouse_answer"]])


NANOCHAT_CHECKPOINT = support.REPO_ROOT / "tests" / "data" / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2"


@pytest.fixture(scope="module")
def converted_nanochat(tmp_path_factory):
    """The nanochat reference checkpoint (trained on 64 tokens) converted as a user would."""
    from kvm_maglev.convert.maglev import convert

    return convert(NANOCHAT_CHECKPOINT, tmp_path_factory.mktemp("nanochat") / "model", step=10)


def test_loglikelihood_on_four_times_the_training_length(converted_nanochat):
    """lm-eval scores the whole long context (no truncation to the training length), as a direct forward does."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    trained = json.loads((NANOCHAT_CHECKPOINT / "meta_000010.json").read_text())["model_config"]["sequence_len"]
    tokenizer = AutoTokenizer.from_pretrained(converted_nanochat, trust_remote_code=True)
    text_ids = tokenizer(" ".join(support.corpus_lines()), add_special_tokens=False)["input_ids"]
    context, continuation = tokenizer.decode(text_ids[: 4 * trained + 8]), " the lighthouse"
    assert len(encode_pair(tokenizer, context, continuation)[0]) > 4 * trained
    lm = HFLM(pretrained=str(converted_nanochat), trust_remote_code=True, batch_size=1, device="cpu",
              dtype="float32")
    request = Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)
    [(harness_ll, harness_greedy)] = lm.loglikelihood([request])
    model = AutoModelForCausalLM.from_pretrained(converted_nanochat, trust_remote_code=True).eval()
    ll, greedy = direct_loglikelihood(model, tokenizer, context, continuation)
    assert harness_ll == pytest.approx(ll, abs=1e-4) and harness_greedy == greedy
    # the usable context is what lm-eval and the tokenizer see; the training length has a field of its own
    config = json.loads((converted_nanochat / "config.json").read_text())
    assert lm.max_length == tokenizer.model_max_length == config["max_position_embeddings"] > 4 * trained
    assert config["sequence_len"] == trained
