"""Fast tokenizer class for nanochat-trained models, shipped beside the model as remote code.

Special tokens written in text are recognised, as in any fast tokenizer; `split_special_tokens=True`
encodes them as plain text instead (as nanochat's encode does), while the chat template's own
control tokens still become special ids. `add_bos_token` (on by default) prepends <|bos|> to plain
text, as nanochat does for a prompt; the chat template writes its own <|bos|>.
This file imports nothing but transformers so that it can be copied to the Hub as it is.
"""

from transformers import PreTrainedTokenizerFast


class NanochatTokenizerFast(PreTrainedTokenizerFast):
    """PreTrainedTokenizerFast whose chat template keeps its control tokens even with `split_special_tokens=True`.

    `add_bos_token` and `split_special_tokens` come from tokenizer_config.json. No __init__ here on
    purpose: transformers 5 loads tokenizer.json only for subclasses that do not define one.
    """

    @property
    def add_bos_token(self) -> bool:
        """Whether plain text gets <|bos|> first. tokenizer.json's post-processor keeps this between saves
        (transformers 5 drops `add_bos_token` from tokenizer_config.json), so it is read from there."""
        if getattr(self, "_applying_bos_token", False) or getattr(self, "_tokenizer", None) is None:
            return getattr(self, "_add_bos_token", False)
        bos_id = self.convert_tokens_to_ids(self.bos_token) if self.bos_token is not None else None
        return bos_id is not None and self._tokenizer.encode("", add_special_tokens=True).ids[:1] == [bos_id]

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        object.__setattr__(self, "_add_bos_token", bool(value))
        self.update_post_processor()

    def update_post_processor(self) -> None:
        """Rebuild the post-processor from the requested `add_bos_token`, not from the current one."""
        applying = getattr(self, "_applying_bos_token", False)
        object.__setattr__(self, "_applying_bos_token", True)
        try:
            super().update_post_processor()
        finally:
            object.__setattr__(self, "_applying_bos_token", applying)

    def apply_chat_template(self, conversation, *args, **kwargs):
        """Render with the template, matching its control tokens (as nanochat's render_conversation emits them)."""
        split_special_tokens = self.split_special_tokens
        self.split_special_tokens = False
        try:
            return super().apply_chat_template(conversation, *args, **kwargs)
        finally:
            self.split_special_tokens = split_special_tokens
