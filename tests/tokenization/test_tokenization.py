"""Tokenizers in Hugging Face form: nanochat's tiktoken encoding and the KVM research GPT-2 BPE."""

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import tiktoken
from safetensors import safe_open

from kvm_maglev.tokenization.gpt2 import generation_token_fields, load_research_tokenizer, padded_token_ids
from kvm_maglev.tokenization.nanochat import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_nanochat_tokenizer,
    find_nanochat_tokenizer,
    load_nanochat_tokenizer,
    nanochat_generation_token_fields,
    read_nanochat_encoding,
)


@pytest.fixture(scope="module")
def nanochat_dir(data_dir):
    return data_dir / "nanochat" / "tiny_sl"


@pytest.fixture(scope="module")
def encoding(nanochat_dir):
    return read_nanochat_encoding(nanochat_dir / "tokenizer" / "tokenizer.pkl")


@pytest.fixture(scope="module")
def tokenizer(encoding):
    return build_nanochat_tokenizer(encoding)


@pytest.fixture(scope="module")
def reference_tiktoken(encoding):
    """tiktoken built from the safely read state: the reference nanochat's encode() uses."""
    return tiktoken.Encoding(
        name=encoding.name,
        pat_str=encoding.pattern,
        mergeable_ranks=encoding.mergeable_ranks,
        special_tokens=encoding.special_tokens,
    )


@pytest.fixture(scope="module")
def reference(nanochat_dir):
    with safe_open(str(nanochat_dir / "reference.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["nanochat_reference"])
        tensors = {key: f.get_tensor(key).tolist() for key in f.keys() if not key.startswith(("logits", "decode"))}
    return meta, tensors


_WHITESPACE = [" ", "  ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", " \n ", "\t\t "]
_WORDS = ["hello", "World", "license", "GNU", "the", "Free", "naïve", "café", "Straße", "你好", "мир", "🌍", "🙂🙂"]
_CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'ll", "'LL", "'d", "'m", "’s", "''", "'"]
_UNICODE_RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF),
                   (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAC80), (0x1F300, 0x1F64F),
                   (0xE000, 0xE010), (0x10000, 0x10100), (0x0, 0x1F)]


def _random_char(rng: random.Random) -> str:
    low, high = rng.choice(_UNICODE_RANGES)
    return chr(rng.randint(low, high))


def _random_piece(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return "".join(_random_char(rng) for _ in range(rng.randint(1, 8)))
    if kind == 1:
        return rng.choice(_WHITESPACE) * rng.randint(1, 4)
    if kind == 2:
        return "".join(rng.choice("0123456789٠١٢٣") for _ in range(rng.randint(1, 9)))
    if kind == 3:
        special = rng.choice(SPECIAL_TOKENS)
        return rng.choice([special, special[:-2], special[2:], f" {special} ", special * 2])
    if kind == 4:
        return rng.choice(_WORDS) + rng.choice(_CONTRACTIONS)
    if kind == 5:
        return rng.choice(_WORDS)
    return rng.choice([".", ",", "!?", "...", "(", ")", "--", "'", '"', "<|", "|>", "$$", "\\"])


def _generated_strings(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    strings = ["", " ", "\n", "<|bos|>", "<|assistant_end|>", "a" * 300, " " * 50, "1" * 33]
    while len(strings) < count:
        strings.append("".join(_random_piece(rng) for _ in range(rng.randint(1, 12))))
    return strings


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_ids_equal_tiktoken_on_generated_strings(tokenizer, reference_tiktoken, split_special_tokens):
    """Special-token text is recognised as tiktoken's allowed_special="all" does, or (split) read as
    plain text as nanochat's encode_ordinary does."""
    if split_special_tokens:
        expected = reference_tiktoken.encode_ordinary
    else:
        def expected(text):
            return reference_tiktoken.encode(text, allowed_special="all")
    mismatches = []
    for text in _generated_strings(400):
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens)
        if ids != expected(text):
            mismatches.append(text)
        elif tokenizer.decode(ids) != text:
            mismatches.append(("decode", text))
    assert not mismatches, f"{len(mismatches)} strings differ from tiktoken, e.g. {mismatches[:3]!r}"


def test_special_token_text_becomes_the_special_id(tokenizer, encoding, reference_tiktoken):
    for text, token_id in encoding.special_tokens.items():
        assert tokenizer.convert_tokens_to_ids(text) == token_id
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id]
        assert token_id not in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tokenizer("<|bos|>hello", add_special_tokens=False)["input_ids"] == [
        351, *reference_tiktoken.encode_ordinary("hello")
    ]
    assert len(tokenizer) == encoding.vocab_size == 360
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>", "<|assistant_end|>", "<|assistant_end|>"
    )
    assert nanochat_generation_token_fields(tokenizer) == {
        "bos_token_id": 351, "eos_token_id": [355, 351], "pad_token_id": 355
    }


def test_plain_text_starts_with_bos_as_nanochat_prompts_do(encoding, reference_tiktoken):
    """nanochat encodes a prompt as `encode(text, prepend=<|bos|>)`; add_bos_token switches that off."""
    tok = build_nanochat_tokenizer(encoding)
    text = "hi there"
    plain = reference_tiktoken.encode_ordinary(text)
    assert tok.add_bos_token
    assert tok(text)["input_ids"] == [351, *plain]
    assert tok(text, add_special_tokens=False)["input_ids"] == plain
    assert tok([text, "a"])["input_ids"] == [[351, *plain], [351, *reference_tiktoken.encode_ordinary("a")]]
    tok.add_bos_token = False
    assert not tok.add_bos_token and tok(text)["input_ids"] == plain
    tok.add_bos_token = True
    assert tok(text)["input_ids"] == [351, *plain]
    assert build_nanochat_tokenizer(encoding, add_bos_token=False)(text)["input_ids"] == plain


def test_chat_template_writes_one_bos(tokenizer, reference_tiktoken):
    messages = [{"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, return_dict=False)
    assert ids == [351, 352, *reference_tiktoken.encode_ordinary("hi"), 353]


def test_fixed_strings_equal_fixture(tokenizer, reference):
    meta, tensors = reference
    for i, text in enumerate(meta["strings"]):
        # the fixture holds nanochat's encode(): special-token text as plain text
        assert tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) == tensors[f"str_ids_{i}"]
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == tensors["special_token_ids"]


def test_chat_template_equals_render_conversation(tokenizer, reference):
    meta, tensors = reference
    messages = meta["conversation"]["messages"]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == tensors["conv_ids"]
    assert out["assistant_masks"] == tensors["conv_mask"]
    # render_for_completion drops the final assistant message and primes a new one
    completion = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
    assert completion == tensors["conv_completion_ids"]


def test_chat_template_matches_render_rules_without_system(tokenizer, reference_tiktoken):
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    ids = tokenizer.apply_chat_template(messages, return_dict=False)
    encode = reference_tiktoken.encode_ordinary
    assert ids == [351, 352, *encode("2 + 2?"), 353, 354, *encode("4"), 355]


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "assistant", "content": "hi"}], "alternate"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "followed by a user"),
        ([{"role": "user", "content": "u"}, {"role": "assistant", "content": [{"type": "image", "text": ""}]}],
         "Unknown assistant content part type"),
    ],
)
def test_chat_template_rejects_what_nanochat_rejects(tokenizer, messages, message):
    with pytest.raises(Exception, match=message):
        tokenizer.apply_chat_template(messages, tokenize=False)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_code_is_refused(tmp_path):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ValueError, match=r"refusing to load global '(posix|os)\.system'"):
        read_nanochat_encoding(path)


def test_broken_pickles_give_clear_errors(tmp_path, nanochat_dir):
    good = (nanochat_dir / "tokenizer" / "tokenizer.pkl").read_bytes()
    truncated = tmp_path / "truncated.pkl"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="not a readable tokenizer pickle"):
        read_nanochat_encoding(truncated)
    not_encoding = tmp_path / "dict.pkl"
    not_encoding.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="expected a pickled tiktoken.Encoding"):
        read_nanochat_encoding(not_encoding)
    with pytest.raises(ValueError, match="cannot read"):
        read_nanochat_encoding(tmp_path / "missing.pkl")


def test_real_tiktoken_pickle_reads_back(tmp_path, reference_tiktoken, encoding):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(reference_tiktoken))
    assert read_nanochat_encoding(path) == encoding


def test_find_tokenizer_in_nanochat_layouts(tmp_path, nanochat_dir, monkeypatch):
    expected = (nanochat_dir / "tokenizer" / "tokenizer.pkl").resolve()
    model_dir = nanochat_dir / "base_checkpoints" / "d2"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "empty"))
    assert find_nanochat_tokenizer(model_dir).resolve() == expected
    assert find_nanochat_tokenizer(model_dir / "model_000010.pt").resolve() == expected
    assert find_nanochat_tokenizer(explicit=nanochat_dir / "tokenizer").resolve() == expected
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(nanochat_dir))
    assert find_nanochat_tokenizer(tmp_path).resolve() == expected
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--tokenizer"):
        find_nanochat_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no nanochat tokenizer"):
        find_nanochat_tokenizer(explicit=tmp_path)


_FRESH_PROCESS_CHECK = textwrap.dedent(
    """
    import json, sys
    sys.modules["kvm_maglev"] = None  # the saved folders must work without this package
    from transformers import AutoTokenizer
    nanochat_dir, gpt2_dir, messages, text = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    nanochat = AutoTokenizer.from_pretrained(nanochat_dir, trust_remote_code=True)
    gpt2 = AutoTokenizer.from_pretrained(gpt2_dir)
    print(json.dumps({
        "encode": nanochat.encode(text, add_special_tokens=False, split_special_tokens=True),
        "encode_default": nanochat.encode(text),
        "special_text": nanochat.encode("<|bos|>hi", add_special_tokens=False),
        "add_bos_token": nanochat.add_bos_token,
        "no_bos": AutoTokenizer.from_pretrained(nanochat_dir, trust_remote_code=True, add_bos_token=False).encode(text),
        "chat": nanochat.apply_chat_template(messages, return_dict=False),
        "specials": [nanochat.bos_token, nanochat.eos_token, nanochat.pad_token],
        "template": nanochat.chat_template,
        "gpt2": [gpt2.encode(text), gpt2.model_max_length, gpt2.eos_token],
    }))
    """
)


def test_saved_tokenizers_reload_in_fresh_process(tmp_path, tokenizer, reference, data_dir):
    meta, tensors = reference
    tokenizer.save_pretrained(tmp_path / "nanochat")
    gpt2 = load_research_tokenizer(data_dir / "kvm" / "kvm_fixed" / "research_final", model_max_length=4096)
    gpt2.save_pretrained(tmp_path / "gpt2")
    text = meta["strings"][5]
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_CHECK, str(tmp_path / "nanochat"), str(tmp_path / "gpt2"),
         json.dumps(meta["conversation"]["messages"]), text],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["encode"] == tensors["str_ids_5"]
    with_specials = tokenizer.encode(text, add_special_tokens=False)  # <|bos|>, <|user_start|> as their ids
    assert with_specials != tensors["str_ids_5"]
    assert loaded["encode_default"] == [351, *with_specials] and loaded["add_bos_token"] is True
    assert loaded["no_bos"] == with_specials
    assert loaded["special_text"] == [351, *tokenizer.encode("hi", add_special_tokens=False)]
    assert loaded["chat"] == tensors["conv_ids"]
    assert loaded["specials"] == ["<|bos|>", "<|assistant_end|>", "<|assistant_end|>"]
    assert loaded["template"] == CHAT_TEMPLATE
    assert loaded["gpt2"] == [gpt2.encode(text), 4096, "<|endoftext|>"]


_REGISTERED_LOAD = textwrap.dedent(
    """
    import sys
    from transformers import AutoTokenizer
    import kvm_maglev
    folder = sys.argv[1]
    try:
        AutoTokenizer.from_pretrained(folder)  # no trust_remote_code: refused before registration
        print("loaded")
    except ValueError as error:
        print("refused" if "trust_remote_code" in str(error) else repr(error))
    kvm_maglev.register_auto_classes()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(type(tokenizer).__module__, type(tokenizer).__name__, tokenizer("hi")["input_ids"])
    """
)


def test_register_auto_classes_covers_the_nanochat_tokenizer(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-c", _REGISTERED_LOAD, str(tmp_path)], capture_output=True, text=True,
                            timeout=180, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    refused, registered = result.stdout.strip().splitlines()[-2:]
    assert refused.endswith("refused")  # after transformers' "run the custom code? [y/N]" prompt
    module = "kvm_maglev.tokenization.tokenization_nanochat"
    assert registered == f"{module} NanochatTokenizerFast {tokenizer('hi')['input_ids']}"


def test_load_from_folder_with_max_length(nanochat_dir):
    tok = load_nanochat_tokenizer(nanochat_dir / "tokenizer", model_max_length=64)
    assert tok.model_max_length == 64


# --- KVM research GPT-2 tokenizer ---


def test_research_tokenizer_carry_and_padding(data_dir):
    folder = data_dir / "kvm" / "kvm_fixed" / "research_final"
    tok = load_research_tokenizer(folder, model_max_length=4096)
    assert tok.model_max_length == 4096
    assert len(tok) == 500
    text = "Key-Value Means, hello world!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    fields = generation_token_fields(tok, 512)
    assert fields["suppress_tokens"] == list(range(500, 512))
    assert fields["eos_token_id"] == fields["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_research_tokenizer_zero_max_length_is_dropped(data_dir):
    tok = load_research_tokenizer(data_dir / "kvm" / "kvm_fixed" / "research_final")
    assert tok.model_max_length > 10**9  # transformers' "no limit" instead of the trainer's 0


def test_research_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_research_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot load"):
        load_research_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        padded_token_ids(50257, 50000)
    assert padded_token_ids(50257, 50304) == list(range(50257, 50304))
