"""Research tokenizers in Hugging Face form: nanochat's tiktoken encoding and the KVM run's GPT-2 BPE."""

from .gpt2 import generation_token_fields, load_research_tokenizer, padded_token_ids
from .nanochat import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    NanochatEncoding,
    build_nanochat_tokenizer,
    find_nanochat_tokenizer,
    load_nanochat_tokenizer,
    nanochat_generation_token_fields,
    read_nanochat_encoding,
)
from .tokenization_nanochat import NanochatTokenizerFast

__all__ = [
    "CHAT_TEMPLATE", "SPECIAL_TOKENS", "NanochatEncoding", "NanochatTokenizerFast", "build_nanochat_tokenizer",
    "find_nanochat_tokenizer", "generation_token_fields", "load_nanochat_tokenizer", "load_research_tokenizer",
    "nanochat_generation_token_fields", "padded_token_ids", "read_nanochat_encoding",
]
