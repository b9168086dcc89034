"""Model cards (README.md) for converted folders, filled from the config into per-architecture templates.

The cache table comes from `cache_sizes.cache_bytes` / `full_attention_cache_bytes` of the config, so the
card states what the shipped cache code actually allocates.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from importlib import resources
from string import Template

import torch
from huggingface_hub import ModelCard, ModelCardData

from kvm_maglev.cache_sizes import cache_bytes, full_attention_cache_bytes

CACHE_TABLE_TOKENS = (4096, 32768, 131072, 1048576)
ARCHITECTURES = ("kvm", "maglev")
_TITLES = {"kvm": "KVM (Key-Value Means) language model", "maglev": "Maglev (Sliding Recurrent Memory) language model"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Provenance:
    """Where the weights came from: the research file, its training step and its sha256."""

    source_path: str
    sha256: str
    step: int | None = None


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large checkpoints do not fill memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def format_bytes(num_bytes: int) -> str:
    """Binary-unit size, e.g. 1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(count: int) -> str:
    """Parameter count with a readable suffix, e.g. 124439808 -> '124.44M (124,439,808)'."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix} ({count:,})"
    return f"{count:,}"


def _format_tokens(num_tokens: int) -> str:
    return f"{num_tokens // 1048576}M" if num_tokens % 1048576 == 0 else f"{num_tokens // 1024}k"


def cache_table_rows(config, dtype: torch.dtype = torch.bfloat16, token_counts=CACHE_TABLE_TOKENS) -> str:
    """Markdown rows: tokens | model cache | full-attention cache | ratio, for batch size 1."""
    rows = []
    for num_tokens in token_counts:
        ours = cache_bytes(config, num_tokens, batch_size=1, dtype=dtype)
        full = full_attention_cache_bytes(config, num_tokens, batch_size=1, dtype=dtype)
        ratio = f"{full / ours:.1f}x smaller" if ours else "-"
        rows.append(f"| {_format_tokens(num_tokens)} | {format_bytes(ours)} | {format_bytes(full)} | {ratio} |")
    return "\n".join(rows)


def _kvm_architecture(config) -> tuple[str, list[tuple[str, object]]]:
    mode = config.state_budget_mode
    grouped = config.kv_heads != config.num_attention_heads
    heads = (f"{config.num_attention_heads} query heads sharing {config.kv_heads} key-value heads (grouped-query "
             "attention: the window and the state are kept once per key-value head)" if grouped
             else f"{config.num_attention_heads} heads")
    paragraph = (
        f"{config.num_hidden_layers} layers of width {config.hidden_size} with {heads}. "
        f"Each KVM layer attends exactly within a block sliding window of {config.window_chunks} chunks of "
        f"{config.chunk_size} tokens and, beyond it, to a compact state of key-value means: tokens leaving the "
        f"window are appended to the state or merged into its most similar slot, so the state grows by the "
        f"'{mode}' budget rule (at least {config.state_budget_min} slots) instead of with every token"
        + (f", with {config.sink_slots} sink slot(s)" if config.sink_slots else "")
        + "."
    )
    if getattr(config, "sliding_window_every", 0):
        paragraph += (
            f" Every {config.sliding_window_every}th layer is a plain sliding-window attention layer"
            f" (window {config.sliding_window})."
        )
    rows = [
        ("layers", config.num_hidden_layers), ("hidden size", config.hidden_size),
        ("attention heads (query / key-value)", f"{config.num_attention_heads} / {config.kv_heads}") if grouped
        else ("attention heads", config.num_attention_heads), ("chunk size", config.chunk_size),
        ("window chunks", config.window_chunks), ("state budget", f"{mode}, min {config.state_budget_min}"),
        ("sink slots", config.sink_slots), ("vocabulary", config.vocab_size),
    ]
    return paragraph, rows


def _maglev_architecture(config) -> tuple[str, list[tuple[str, object]]]:
    heads = f"{config.num_attention_heads} query heads and {config.num_key_value_heads} key-value heads"
    if config.sliding_window is not None:
        attention = f"every layer attends within a sliding window of {config.sliding_window} tokens"
    else:
        attention = f"layers follow nanochat's window pattern '{config.window_pattern}'"
    paragraph = f"A nanochat GPT backbone: {config.num_hidden_layers} layers of width {config.hidden_size}, {heads}; {attention}."
    if config.use_memory:
        paragraph += (
            " A recurrent memory vector carries information past the window: each step's memory is written"
            " into the next step's keys and values through gated projections, so context older than the window"
            " reaches the model without keeping its keys and values."
        )
        if config.has_prefiller:
            paragraph += (
                f" A prefiller (window pattern '{config.prefiller_window_pattern}', "
                + ("sharing the decoder's blocks" if config.prefiller_shares_blocks else "with its own blocks")
                + ") is kept: it supplies the memories in parallel during training and can process long prompts."
            )
    rows = [
        ("layers", config.num_hidden_layers), ("hidden size", config.hidden_size),
        ("attention heads (query / key-value)", f"{config.num_attention_heads} / {config.num_key_value_heads}"),
        ("sliding window", config.sliding_window), ("window pattern", config.window_pattern),
        ("memory", config.use_memory), ("vocabulary", config.vocab_size),
    ]
    if config.use_memory:
        rows.append(("training recipe", maglev_training_recipe(config)))
    return paragraph, rows


def maglev_training_recipe(config, recipe: str | None = None) -> str:
    """The memory-training switches a Maglev config records, in words (what the model was, or will be, trained with);
    `recipe`, a name of `kvm_maglev.training.MAGLEV_RECIPES` the model was trained with, adds its name and its
    schedule, which a config does not record (a schedule is a training callback)."""
    parts = [f"lifted parallel training, consistency {config.consistency_weight} ({config.consistency_loss})"]
    if config.memory_self_feed_steps:
        mix = "" if config.memory_self_feed_mix >= 1 else f", mixed with p={config.memory_self_feed_mix}"
        detach = ", detached between passes" if config.memory_self_feed_detach else ""
        parts.append(f"P fed its own memories in {config.memory_self_feed_steps} more passes{mix}{detach}")
    if config.memory_projection or config.memory_source_layer is not None:
        source = "h" if config.memory_source_layer is None else f"block {config.memory_source_layer}'s output"
        parts.append(f"memory read from {source}" + (" through a projection" if config.memory_projection else ""))
    if config.memory_residual_injection:
        parts.append("memory also added to P's block input")
    if config.memory_noise_std:
        parts.append(f"memory noise {config.memory_noise_std}")
    if config.consistency_detach_target_after is not None:
        parts.append(f"prefiller frozen as teacher from step {config.consistency_detach_target_after}")
    parts.append(f"{config.weight_init} init")
    if recipe is None:
        return "; ".join(parts)
    from kvm_maglev.training import MAGLEV_SCHEDULES

    if recipe in MAGLEV_SCHEDULES:
        parts.append(f"P trained on its own rollouts (the inference forward) for the last "
                     f"{100 * (1 - MAGLEV_SCHEDULES[recipe]):.0f}% of the optimizer steps")
    return f"`{recipe}`: " + "; ".join(parts)


_ARCHITECTURE_TEXT = {"kvm": _kvm_architecture, "maglev": _maglev_architecture}


def _provenance_text(provenance: Provenance | None) -> str:
    if provenance is None:
        return "Not recorded."
    lines = [f"- source: `{provenance.source_path}`"]
    if provenance.step is not None:
        lines.append(f"- training step: {provenance.step}")
    lines.append(f"- sha256 of the source file: `{provenance.sha256}`")
    return "\n".join(lines)


def card_metadata(
    architecture: str,
    *,
    license: str | None = None,
    base_model: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    extra_tags: list[str] | None = None,
) -> ModelCardData:
    """Hub metadata: transformers text-generation with remote code, tagged with the architecture."""
    tags = ["custom_code", architecture, "long-context", *(extra_tags or [])]
    return ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
        license=license,
        base_model=base_model,
        datasets=datasets,
    )


def render_model_card(
    config,
    *,
    num_parameters: int,
    architecture: str | None = None,
    repo_id: str = "path/to/this/folder",
    license: str | None = None,
    base_model: str | list[str] | None = None,
    datasets: str | list[str] | None = None,
    provenance: Provenance | None = None,
    cache_dtype: torch.dtype = torch.bfloat16,
    title: str | None = None,
    recipe: str | None = None,
) -> str:
    """Fill the architecture's template from `config`; the result's metadata is checked with ModelCard. `recipe`: the
    Maglev memory-training recipe the weights were trained with, named in the card with its schedule."""
    architecture = architecture or getattr(config, "model_type", None)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"no model card template for architecture {architecture!r}; expected one of {ARCHITECTURES}")
    if cache_dtype not in _DTYPE_NAMES:
        raise ValueError(f"cache_dtype must be one of {list(_DTYPE_NAMES.values())}, got {cache_dtype}")
    if num_parameters <= 0:
        raise ValueError(f"num_parameters must be positive, got {num_parameters}")
    paragraph, rows = _ARCHITECTURE_TEXT[architecture](config)
    if recipe is not None and architecture == "maglev" and config.use_memory:
        rows = [(name, maglev_training_recipe(config, recipe) if name == "training recipe" else value)
                for name, value in rows]
    metadata = card_metadata(architecture, license=license, base_model=base_model, datasets=datasets)
    template = Template(resources.files("kvm_maglev.model_cards").joinpath(f"{architecture}.md").read_text("utf-8"))
    text = template.substitute(
        metadata=metadata.to_yaml(),
        title=title or _TITLES[architecture],
        repo_id=repo_id,
        snippet_dtype=f"torch.{_DTYPE_NAMES[cache_dtype]}",
        architecture=paragraph,
        config_rows="\n".join(f"| {name} | {value} |" for name, value in rows),
        num_parameters=format_count(num_parameters),
        cache_dtype=_DTYPE_NAMES[cache_dtype],
        cache_rows=cache_table_rows(config, cache_dtype),
        provenance=_provenance_text(provenance),
    )
    check_model_card(text)
    return text


def check_model_card(text: str) -> ModelCard:
    """Parse the card as the Hub does (YAML metadata, required fields); raise ValueError if it is not valid."""
    try:
        card = ModelCard(text, ignore_metadata_errors=False)
    except Exception as error:  # yaml and huggingface_hub raise their own types
        raise ValueError(f"model card metadata is not valid: {error}") from error
    data = card.data
    if data.library_name != "transformers" or data.pipeline_tag != "text-generation":
        raise ValueError("model card metadata must declare library_name transformers and pipeline_tag text-generation")
    if "custom_code" not in (data.tags or []):
        raise ValueError("model card metadata must carry the custom_code tag")
    return card
