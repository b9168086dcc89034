"""transformers' forward conventions as both models follow them: output switches that default to the config,
refused attention weights, position ids checked against each row's own positions, and the attention
implementations a user can choose ("sdpa": torch's fused kernel; "eager": explicit products, the reference)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

# what `attn_implementation` may name; flash and flex kernels cannot take a compressed state or a ring of keys
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def config_default(value, config, name: str):
    """A forward switch as transformers reads it: the argument when given, else the config's field."""
    return getattr(config, name) if value is None else value


def refuse_attention_weights(output_attentions: bool | None, config, reason: str) -> None:
    """output_attentions=True (argument or config) is refused with `reason`: the models return no weights."""
    if config_default(output_attentions, config, "output_attentions"):
        raise ValueError(f"output_attentions=True is not supported: {reason}. Pass output_attentions=False "
                         "(and leave config.output_attentions False).")


def is_attention_kernel(implementation: str) -> bool:
    """Whether transformers would run `implementation` as a kernel of its own or from the Hub (flash, flex,
    paged, "org/repo" kernels); a name it does not know at all gets transformers' own error."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return implementation in ALL_ATTENTION_FUNCTIONS.valid_keys() or "/" in implementation or \
        implementation.startswith(("paged", "flash", "flex"))


def check_attn_implementation(implementation: str, model_name: str, reason: str) -> str:
    """`implementation` unless it is a kernel the attention cannot run (flash, flex, paged, Hub kernels), which
    is refused with `reason` at load time and by set_attn_implementation."""
    if implementation not in ATTENTION_IMPLEMENTATIONS and is_attention_kernel(implementation):
        raise ValueError(f"attn_implementation={implementation!r} is not supported by {model_name} models ({reason}); "
                         f"choose one of {ATTENTION_IMPLEMENTATIONS}")
    return implementation


class SdpaOrEagerMixin:
    """Put before PreTrainedModel: "sdpa" and "eager" can be switched by set_attn_implementation (the attention
    reads the config at every call); a kernel the attention cannot run is refused at load and on a switch."""

    attention_model_name: str  # as the refusal names the model
    attention_refusal: str  # why the model's attention takes no flash, flex or paged kernel

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        check_attn_implementation(attn_implementation or "sdpa", self.attention_model_name, self.attention_refusal)
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

class HeadLossMixin:
    """Put before PreTrainedModel: the causal-LM loss is transformers' `self.loss_function` of the model's `logits`,
    as Mistral computes it (the package's models compute the same loss in row blocks, to save memory)."""

    def logits_and_loss(self, hidden: torch.Tensor, labels: torch.Tensor | None,
                        **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's `logits` and, given labels, their loss."""
        logits = self.logits(hidden)
        return logits, None if labels is None else self.head_loss_of(logits, labels, **kwargs)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """The loss of a pass whose logits are not returned."""
        return self.head_loss_of(self.logits(hidden), labels, **kwargs)

    def head_loss_of(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """transformers' causal-LM loss of `logits` (labels shifted inside)."""
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              eager: bool) -> torch.Tensor:
    """Softmax attention of q [B, H, Tq, D] over keys/values [B, Hkv, Tk, D] (Hkv divides H) where the boolean
    `mask` (broadcast to [B, H, Tq, Tk]) is True; every query must see a key. `eager` spells out the products."""
    if not eager:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def check_position_ids(position_ids, positions: torch.Tensor, valid: torch.Tensor | None, batch: int,
                       model_name: str, carried: str) -> bool:
    """Whether `position_ids` [batch or 1, T] differ, on real tokens, from the model's own `positions` ([T] or
    [batch, T]: each row's count of real tokens before, cached ones included, as generate() counts them).

    A restart - a position not above the row's previous one, or 0 after the row's first token, as packed
    sequences (DataCollatorWithFlattening) have - is refused: the model carries its `carried` from each token
    to the next, so the documents would read each other's. One-token steps on accelerators are not checked
    (reading the check's answer would stall the device every token)."""
    length = positions.shape[-1]
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.shape[1] != length \
            or position_ids.shape[0] not in (1, batch) or position_ids.dtype.is_floating_point:
        raise ValueError(f"position_ids must be an integer [{batch}, {length}] tensor, got "
                         f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
    if length == 1:
        if position_ids.device.type != "cpu":
            return False
        return step_position_differs(position_ids, positions, valid, batch, model_name, carried)
    given = position_ids.to(positions.device).long().expand(batch, length)
    own = positions.expand(batch, length)
    real = valid if valid is not None else torch.ones_like(given, dtype=torch.bool)
    reached = torch.where(real, given, -1).cummax(dim=1).values
    previous = torch.cat([reached.new_full((batch, 1), -1), reached[:, :-1]], dim=1)
    if bool((real & ((given <= previous) | ((given == 0) & (own > 0)))).any()):
        raise restart_error(model_name, carried)
    return bool((real & (given != own)).any())


def step_position_differs(position_ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None,
                          batch: int, model_name: str, carried: str) -> bool:
    """`check_position_ids` for a one-token step, on Python numbers: a decoding step is a handful of small
    operations, which tensor checks would slow down measurably."""
    given, own = position_ids.view(-1).tolist(), positions.reshape(-1).tolist()
    given, own = given * (batch // len(given)), own * (batch // len(own))
    real = valid.view(-1).tolist() if valid is not None else [True] * batch
    if any(r and g == 0 and o > 0 for r, g, o in zip(real, given, own)):
        raise restart_error(model_name, carried)
    return any(r and g != o for r, g, o in zip(real, given, own))


def restart_error(model_name: str, carried: str) -> ValueError:
    """The error for position ids that restart inside a row."""
    return ValueError(f"position_ids restart inside a row (packed sequences, as DataCollatorWithFlattening "
                      f"makes, or a new sequence on a used cache): {model_name} carries its {carried} from one "
                      "token to the next, so the documents would read each other's. Pass each document as a row "
                      "of its own (padded, with an attention_mask) or in a forward of its own.")


def full_precision_modules(*names: str) -> list[str]:
    """A `_keep_in_fp32_modules` list keeping the modules `names` out of every quantizer and float16: each name as
    a module (bitsandbytes, quanto and most quantizers match module names) and as its weight (torchao matches
    parameter names, from the start or as a suffix)."""
    return [entry for name in names for entry in (name, f"{name}.weight")]


class FullPrecisionLinear(nn.Linear):
    """A small linear layer the models keep in full precision (gates: in/out widths of 1-32, too small for 4-bit
    kernels and too sensitive to quantize; listed in `_keep_in_fp32_modules`). A float16 load keeps its weight in
    float32: it computes in its weight's dtype and returns its input's. In one dtype it is nn.Linear exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


# where each quantization config holds a user's list of modules to keep unquantized (bitsandbytes; torchao, quanto
# and others; HQQ)
SKIP_LIST_FIELDS = ("llm_int8_skip_modules", "modules_to_not_convert", "skip_modules")


def with_head_kept(quantization_config):
    """`quantization_config` (a config or its dict), its user's skip list also naming the head: transformers lets a
    user's list replace its default one (the head), and a quantized head costs the logits their precision."""
    is_dict = isinstance(quantization_config, dict)
    for field in SKIP_LIST_FIELDS:
        skipped = quantization_config.get(field) if is_dict else getattr(quantization_config, field, None)
        if skipped is not None and "lm_head" not in skipped:
            if is_dict:
                quantization_config = {**quantization_config, field: [*skipped, "lm_head"]}
            else:
                quantization_config = copy.copy(quantization_config)  # the user's own stays as they made it
                setattr(quantization_config, field, [*skipped, "lm_head"])
    return quantization_config


class QuantizedLoadMixin:
    """transformers' from_pretrained, with the head kept out of a quantizer a user gave their own skip list, and
    bitsandbytes' 4-bit layers kept out of their AVX512-BF16 CPU repacking: bitsandbytes 0.50 repacks a 4-bit weight
    at its first eval forward on such CPUs, and `state_dict()` after that writes corrupted weights (save_pretrained,
    Trainer checkpoints and adapter saves of the model). Without the repacking the layers compute with bitsandbytes'
    plain CPU kernel; elsewhere the switch is already off."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("quantization_config") is not None:
            kwargs["quantization_config"] = with_head_kept(kwargs["quantization_config"])
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True returns a tuple
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):  # bitsandbytes' Linear4bit
                module.support_avx512bf16_for_cpu = False
        return loaded

