"""Carry a checkpoint's model card into what `save_pretrained` writes and `push_to_hub` uploads.

transformers writes no card on save and uploads its blank template on push, so a fine-tuned KVM or Maglev
model would lose the card that says what it is (architecture, cache, training recipe, provenance). The card
of the checkpoint a model was loaded from travels with it instead, naming that checkpoint as the base model
when it came from the Hub; a local source's path never goes into the card.
"""

from __future__ import annotations

import os
from pathlib import Path

# the sentence of transformers' blank template card, which a carried card replaces
BLANK_CARD_SENTENCE = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."
NOTE_START = "Saved again from "  # the first words of the note a carried card gets (one note, replaced on re-save)


def source_card_text(name_or_path: str) -> str | None:
    """README.md of the folder or Hub repo a model was loaded from; None when there is none or it cannot be read."""
    if not name_or_path:
        return None
    folder = Path(name_or_path)
    if folder.is_dir():
        card = folder / "README.md"
        return card.read_text(encoding="utf-8") if card.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(name_or_path, "README.md")).read_text(encoding="utf-8")
    except Exception:  # no card, no network, not a repo id: carry nothing rather than fail a save
        return None


def carried_card_text(card_text: str, name_or_path: str, extra_tags: list[str] | None = None) -> str:
    """The source card updated for a model saved again from it (e.g. fine-tuned): a Hub source becomes
    `base_model`, a note under the title says where the weights came from, and `extra_tags` are added."""
    from huggingface_hub import ModelCard

    card = ModelCard(card_text)
    if Path(name_or_path).is_dir():
        note = f"{NOTE_START}a local copy of the model described below (for example after fine-tuning)."
    else:
        card.data.base_model = name_or_path
        note = (f"{NOTE_START}[{name_or_path}](https://huggingface.co/{name_or_path}) (for example after "
                "fine-tuning); the sections below describe that model.")
    tags = list(card.data.tags or [])
    tags += [tag for tag in extra_tags or [] if tag not in tags]
    card.data.tags = tags or None
    lines = [line for line in card.text.split("\n") if not line.startswith(NOTE_START)]
    title = lines[:1] if lines and lines[0].startswith("#") else []
    rest = lines[len(title):]
    while rest and not rest[0].strip():
        rest.pop(0)
    card.text = "\n".join(title + ([""] if title else []) + [note, ""] + rest)
    return str(card)


class CarriedCardMixin:
    """Put before PreTrainedModel: `save_pretrained` writes the carried card when the folder has none, and
    `push_to_hub` uploads it in place of transformers' blank template (an existing card on the Hub stays)."""

    def carried_card(self, extra_tags: list[str] | None = None) -> str | None:
        source = getattr(self.config, "_name_or_path", "") or ""
        # read once per source: Trainer saves a checkpoint every few steps, and a Hub source costs a request
        cached = getattr(self, "_source_card", None)
        if cached is None or cached[0] != source:
            cached = self._source_card = (source, source_card_text(source))
        text = cached[1]
        return carried_card_text(text, source, extra_tags) if text else None

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        readme = Path(save_directory) / "README.md"
        if kwargs.get("is_main_process", True) and not readme.exists():
            card = self.carried_card()
            if card is not None:
                readme.write_text(card, encoding="utf-8")
        return result

    def _upload_modified_files(self, working_dir: str | os.PathLike, *args, **kwargs):
        readme = Path(working_dir) / "README.md"
        if readme.is_file() and BLANK_CARD_SENTENCE in readme.read_text(encoding="utf-8"):
            from huggingface_hub import ModelCard

            card = self.carried_card(extra_tags=list(ModelCard.load(readme).data.tags or []))
            if card is not None:
                readme.write_text(card, encoding="utf-8")
        return super()._upload_modified_files(working_dir, *args, **kwargs)
