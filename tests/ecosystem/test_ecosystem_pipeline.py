"""pipeline("text-generation", trust_remote_code=True): plain prompts and chat messages."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PROMPT = "The keeper climbs the stairs"
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def generator(model_dir):
    return pipeline("text-generation", model=str(model_dir), trust_remote_code=True, device="cpu")


def direct_greedy(model_dir, input_ids: torch.Tensor) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    return model.generate(input_ids=input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()


def test_pipeline_generates_what_generate_does(model_dir, generator):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    tokens = generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, return_tensors=True,
                       add_special_tokens=False)[0]["generated_token_ids"]
    assert list(tokens) == direct_greedy(model_dir, ids)
    text = generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    assert isinstance(text, str) and text.startswith(PROMPT)


def test_plain_prompt_starts_as_the_model_was_trained(model_dir, generator):
    """Plain text gets nanochat's <|bos|> first (as nanochat's prompts); GPT-2 text gets nothing."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    prefix = [tokenizer.convert_tokens_to_ids("<|bos|>")] if "<|bos|>" in tokenizer.get_vocab() else []
    assert bool(prefix) == (model_dir.name == "model_maglev")
    ids = torch.tensor([prefix + tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    tokens = generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, return_tensors=True)[0]
    assert list(tokens["generated_token_ids"]) == direct_greedy(model_dir, ids)


def test_chat_messages_through_the_pipeline_follow_the_chat_template(model_dir, generator):
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    if tokenizer.chat_template is None:
        pytest.skip("this checkpoint's tokenizer has no chat template (a base model)")
    messages = [{"role": "user", "content": "Where does the cat sleep?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = direct_greedy(model_dir, ids["input_ids"])
    result = generator(messages, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    assert result[:-1] == messages and result[-1]["role"] == "assistant"
    new_text = tokenizer.decode(expected[ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert result[-1]["content"] == new_text
