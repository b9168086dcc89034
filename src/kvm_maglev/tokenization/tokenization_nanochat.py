"""Fast tokenizer class for nanochat-trained models, shipped beside the model as remote code.

nanochat encodes special-token text found in ordinary text as plain text, so the tokenizer splits
special tokens by default; only the chat template's own control tokens must become special ids.
This file imports nothing but transformers so that it can be copied to the Hub as it is.
"""

from transformers import PreTrainedTokenizerFast


class NanochatTokenizerFast(PreTrainedTokenizerFast):
    """PreTrainedTokenizerFast whose chat template keeps its control tokens while plain text never makes them.

    `split_special_tokens=True` comes from tokenizer_config.json. No __init__ here on purpose:
    transformers 5 loads tokenizer.json only for subclasses that do not define one.
    """

    def apply_chat_template(self, conversation, *args, **kwargs):
        """Render with the template, matching its control tokens (as nanochat's render_conversation emits them)."""
        split_special_tokens = self.split_special_tokens
        self.split_special_tokens = False
        try:
            return super().apply_chat_template(conversation, *args, **kwargs)
        finally:
            self.split_special_tokens = split_special_tokens
