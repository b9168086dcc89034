"""nanochat's tokenizer (a pickled tiktoken encoding) as a Hugging Face fast tokenizer.

The pickle is read by an allow-listing unpickler that only rebuilds the encoding's constructor
arguments, so no pickled code runs and tiktoken is not needed. The fast tokenizer reproduces
tiktoken's ids (byte-level BPE with merges rebuilt from the ranks, the split pattern as a
pre-tokenizer), prepends <|bos|> to plain text as nanochat does for a prompt, and renders chats
as nanochat's render_conversation (a Jinja template).
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .tokenization_nanochat import NanochatTokenizerFast

# nanochat's special tokens, in id order after the mergeable ranks
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
BOS_TOKEN = "<|bos|>"
# nanochat's Engine stops on <|assistant_end|> or <|bos|>, and its SFT loader pads with <|assistant_end|>
EOS_TOKEN = "<|assistant_end|>"
PAD_TOKEN = "<|assistant_end|>"

# Pickled globals the unpickler may resolve: tiktoken's Encoding only (mapped to a stand-in below)
_TIKTOKEN_ENCODING = ("tiktoken.core", "Encoding")


# One template line per step; joined without whitespace so nothing but the tokens is rendered.
# Mirrors render_conversation: a leading system message is merged into the first user message,
# roles alternate user/assistant, assistant text and python calls are trained on ({% generation %}),
# python outputs are not, and <|assistant_end|> is.
_CHAT_TEMPLATE_LINES = (
    "{%- if messages[0]['role'] == 'system' -%}",
    "{%- if messages|length < 2 or messages[1]['role'] != 'user' -%}",
    "{{- raise_exception('A system message must be followed by a user message') -}}",
    "{%- endif -%}",
    "{%- set merged_user = messages[0]['content'] + '\\n\\n' + messages[1]['content'] -%}",
    "{%- set chat = messages[1:] -%}",
    "{%- else -%}",
    "{%- set merged_user = none -%}",
    "{%- set chat = messages -%}",
    "{%- endif -%}",
    "{{- '<|bos|>' -}}",
    "{%- for message in chat -%}",
    "{%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}",
    "{{- raise_exception('Messages must alternate user/assistant (after an optional system message), got '"
    " + message['role'] + ' at position ' + loop.index0|string) -}}",
    "{%- endif -%}",
    "{%- if message['role'] == 'user' -%}",
    "{%- set content = merged_user if (loop.first and merged_user is not none) else message['content'] -%}",
    "{%- if content is not string -%}{{- raise_exception('User messages must be strings') -}}{%- endif -%}",
    "{{- '<|user_start|>' + content + '<|user_end|>' -}}",
    "{%- else -%}",
    "{{- '<|assistant_start|>' -}}",
    "{%- if message['content'] is string -%}",
    "{%- generation -%}{{- message['content'] -}}{%- endgeneration -%}",
    "{%- else -%}",
    "{%- for part in message['content'] -%}",
    "{%- if part['type'] == 'text' -%}",
    "{%- generation -%}{{- part['text'] -}}{%- endgeneration -%}",
    "{%- elif part['type'] == 'python' -%}",
    "{%- generation -%}{{- '<|python_start|>' + part['text'] + '<|python_end|>' -}}{%- endgeneration -%}",
    "{%- elif part['type'] == 'python_output' -%}",
    "{{- '<|output_start|>' + part['text'] + '<|output_end|>' -}}",
    "{%- else -%}",
    "{{- raise_exception('Unknown assistant content part type: ' + part['type']|string) -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- endif -%}",
    "{%- generation -%}{{- '<|assistant_end|>' -}}{%- endgeneration -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}",
)
CHAT_TEMPLATE = "".join(_CHAT_TEMPLATE_LINES)


class _CapturedEncoding:
    """Harmless stand-in for tiktoken.Encoding: keeps the state the pickle hands to __setstate__."""

    def __init__(self) -> None:
        self.state = None

    def __setstate__(self, state) -> None:
        self.state = state


class _EncodingUnpickler(pickle.Unpickler):
    """Unpickler that resolves tiktoken's Encoding to a stand-in and refuses every other global."""

    def find_class(self, module: str, name: str):
        if (module, name) == _TIKTOKEN_ENCODING:
            return _CapturedEncoding
        raise pickle.UnpicklingError(
            f"refusing to load global '{module}.{name}' from the tokenizer pickle: only "
            f"'{'.'.join(_TIKTOKEN_ENCODING)}' is allowed (the file may contain code)"
        )


@dataclass(frozen=True)
class NanochatEncoding:
    """The constructor arguments of nanochat's tiktoken encoding."""

    name: str
    pattern: str
    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self.mergeable_ranks) + len(self.special_tokens)


def read_nanochat_encoding(path: str | os.PathLike) -> NanochatEncoding:
    """Read `tokenizer.pkl` (a pickled tiktoken.Encoding) without running any pickled code."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read nanochat tokenizer {path}: {error}") from error
    try:
        loaded = _EncodingUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as error:
        if "refusing" in str(error):
            raise ValueError(f"{path}: {error}") from error
        raise ValueError(f"{path}: not a readable tokenizer pickle ({error})") from error
    except Exception as error:  # truncated or corrupted bytes surface as many exception types
        raise ValueError(f"{path}: not a readable tokenizer pickle ({type(error).__name__}: {error})") from error
    if not isinstance(loaded, _CapturedEncoding):
        raise ValueError(f"{path}: expected a pickled tiktoken.Encoding, got {type(loaded).__name__}")
    return _encoding_from_state(loaded.state, path)


def _encoding_from_state(state, path: Path) -> NanochatEncoding:
    """Validate the captured Encoding state and turn it into a NanochatEncoding."""
    if isinstance(state, str):
        raise ValueError(
            f"{path}: the pickle refers to tiktoken's registered encoding {state!r} by name; "
            "only self-contained encodings (as nanochat's tokenizer training writes) can be converted"
        )
    if not isinstance(state, dict):
        raise ValueError(f"{path}: unexpected tiktoken.Encoding state of type {type(state).__name__}")
    missing = {"name", "pat_str", "mergeable_ranks", "special_tokens"} - state.keys()
    if missing:
        raise ValueError(f"{path}: tiktoken.Encoding state lacks {sorted(missing)}")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not isinstance(state["pat_str"], str):
        raise ValueError(f"{path}: pat_str must be a string")
    if not isinstance(ranks, dict) or not all(
        isinstance(k, bytes) and type(v) is int for k, v in ranks.items()
    ):
        raise ValueError(f"{path}: mergeable_ranks must map bytes to int")
    if not isinstance(specials, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in specials.items()
    ):
        raise ValueError(f"{path}: special_tokens must map str to int")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: mergeable ranks are not the contiguous ids 0..{len(ranks) - 1}")
    expected_special_ids = list(range(len(ranks), len(ranks) + len(specials)))
    if sorted(specials.values()) != expected_special_ids:
        raise ValueError(f"{path}: special token ids must follow the ranks contiguously, got {specials}")
    return NanochatEncoding(str(state["name"]), state["pat_str"], dict(ranks), dict(specials))


def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and the merges that reproduce tiktoken's lowest-rank-first merging.

    tiktoken merges any adjacent pair whose concatenation is a token, lowest token rank first, so
    every split of a token into two tokens is a merge, ordered by the rank of the merged token.
    """
    byte_map = _byte_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        if len(token) > 1 and not splits:
            raise ValueError(f"token {token!r} (rank {rank}) cannot be built from two smaller tokens")
        merges.extend((as_text(left), as_text(right)) for _, _, left, right in sorted(splits))
    return vocab, merges


def build_backend_tokenizer(encoding: NanochatEncoding) -> Tokenizer:
    """A `tokenizers` byte-level BPE giving the same ids as tiktoken's encode_ordinary."""
    vocab, merges = _bpe_vocab_and_merges(encoding.mergeable_ranks)
    # ignore_merges: a pre-token that is itself a token is emitted whole, as tiktoken does
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(encoding.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = sorted(encoding.special_tokens.items(), key=lambda item: item[1])
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, token_id in specials:
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(f"special token {text!r} got id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer


def build_nanochat_tokenizer(
    encoding: NanochatEncoding, *, model_max_length: int | None = None, add_bos_token: bool = True
) -> NanochatTokenizerFast:
    """The fast tokenizer for a nanochat encoding, with bos/eos/pad and the chat template set.

    Plain text gets <|bos|> first (as nanochat's `encode(text, prepend=bos)` for a prompt) unless
    `add_bos_token=False`; special-token text in it becomes the special ids, as in any fast tokenizer.
    `model_max_length=None` means no limit: the models' cost does not grow with the context.
    """
    missing = [text for text in SPECIAL_TOKENS if text not in encoding.special_tokens]
    if missing:
        raise ValueError(f"the encoding lacks nanochat's special tokens {missing}")
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = NanochatTokenizerFast(
        tokenizer_object=build_backend_tokenizer(encoding),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token=add_bos_token,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        **extra,
    )
    # save_pretrained copies tokenization_nanochat.py beside the files and writes auto_map
    tokenizer.register_for_auto_class("AutoTokenizer")
    return tokenizer


def load_nanochat_tokenizer(
    path: str | os.PathLike, *, model_max_length: int | None = None, add_bos_token: bool = True
) -> NanochatTokenizerFast:
    """Read `tokenizer.pkl` (a file or its folder) safely and build the fast tokenizer."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.pkl"
    encoding = read_nanochat_encoding(path)
    return build_nanochat_tokenizer(encoding, model_max_length=model_max_length, add_bos_token=add_bos_token)


def nanochat_base_dir() -> Path:
    """nanochat's base folder: $NANOCHAT_BASE_DIR, else ~/.cache/nanochat (as nanochat's common.py picks it)."""
    configured = os.environ.get("NANOCHAT_BASE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "nanochat"


def find_nanochat_tokenizer(model_dir: str | os.PathLike | None = None, explicit: str | os.PathLike | None = None) -> Path:
    """Locate `tokenizer.pkl`: the explicit path, else `tokenizer/` two levels above a checkpoint
    folder (`<base>/base_checkpoints/<tag>/`), else nanochat's base folder."""
    if explicit is not None:
        candidate = Path(explicit)
        candidate = candidate / "tokenizer.pkl" if candidate.is_dir() else candidate
        if not candidate.is_file():
            raise ValueError(f"no nanochat tokenizer at {explicit} (expected tokenizer.pkl or a folder holding it)")
        return candidate
    searched = []
    if model_dir is not None:
        model_dir = Path(model_dir).resolve()
        folder = model_dir if model_dir.is_dir() else model_dir.parent
        searched += [folder / "tokenizer", folder.parent.parent / "tokenizer"]
    searched.append(nanochat_base_dir() / "tokenizer")
    for folder in searched:
        if (folder / "tokenizer.pkl").is_file():
            return folder / "tokenizer.pkl"
    raise ValueError(
        "could not find nanochat's tokenizer.pkl; searched " + ", ".join(str(f) for f in searched)
        + "; pass --tokenizer DIR"
    )


def nanochat_generation_token_fields(tokenizer: NanochatTokenizerFast) -> dict:
    """generation_config fields as nanochat's Engine uses them: stop on <|assistant_end|> or <|bos|>."""
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    end_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return {"bos_token_id": bos_id, "eos_token_id": [end_id, bos_id], "pad_token_id": tokenizer.pad_token_id}
