"""KVM (Key-Value Means) model configuration.

Mapping from the research code's `MixerConfig` (github recursal/KVM-paper,
`model/rwkv7_backbone.py`) to `KVMConfig`. The converter applies it; the README
section "KVM config fields" repeats it.

| research `MixerConfig` field | `KVMConfig` field | notes |
|---|---|---|
| vocab_size | vocab_size | |
| hidden_size | hidden_size | |
| num_hidden_layers | num_hidden_layers | |
| num_attention_heads | num_attention_heads | |
| d_qk_head / d_head | head_dim | default hidden_size // num_attention_heads |
| d_v_head / d_head | value_head_dim | default hidden_size // num_attention_heads |
| ffn_expansion | intermediate_size | int(ffn_expansion * hidden_size) // 32 * 32 |
| rope_theta | rope_theta | |
| rope_partial_dim | rotary_dim | rotated channels of a head (KVM layers), zeroed in state keys; default: half the head (research: 64 of 128) |
| alt_rope_theta | sliding_window_rope_theta | |
| alt_rope_partial_dim | sliding_window_rotary_dim | 0 = no rotary in sliding-window layers; default: whole head |
| alt_layer_every | sliding_window_every | layers with index % n == 0 are sliding-window; 0 = none |
| alt_token_mixer | - | only "swa" (rejected otherwise) |
| token_mixer | - | only "kvm" (rejected otherwise) |
| alt_share_v0 | sliding_window_share_value_residual | KVM layers use the first sliding layer's value anchor |
| swa_window_size | sliding_window | <= 0 in research means chunk_len |
| chunk_len | chunk_size | |
| n_bswa_chunks | window_chunks | chunk-aligned blocks in the sliding window |
| sink_len | sink_slots | state slots never merged into |
| n_max_d_chunks | state_max_chunks | state cap = chunk_size * state_max_chunks |
| state_budget_mode | state_budget_mode | "fixed", "power_law", "kvm_saturation" |
| state_growth_factor | state_budget_factor | power_law: factor * N ** exponent |
| state_growth_exponent | state_budget_exponent | |
| state_saturation_n | state_budget_saturation | kvm_saturation: n * N / (n + N) |
| state_min_len | state_budget_min | fixed: the budget; others: the floor |
| state_round_down | state_budget_round_to | budget rounded down to a multiple |
| kvm_use_merge_gate_keys | merge_gate_keys | scale merged keys by 1 + elu(W x) |
| kvm_use_merge_gate_values | merge_gate_values | scale merged values by the gate |
| kvm_apply_merge_gate_to_appends | merge_gate_appends | appended slots gated too |
| kvm_apply_merge_gate_to_initial_state | merge_gate_initial_state | first chunk gated too |
| kvm_use_head_temps | head_temperatures | per-head window/state key scales |
| kvm_use_vlens | state_value_norms | True: renormalise to slot norm; False: divide by counts (research: +1 on every slot per merged block; only with a one-chunk state) |
| use_tokenshift_att + kvm_token_shift_mode | kvm_token_shift | token shift of q/k/v in KVM layers |
| use_tokenshift_att + swa_token_shift_mode | sliding_window_token_shift | same, sliding-window layers |
| use_tokenshift_ffn | ffn_token_shift | |
| use_value_residual | value_residual | |
| kvm_value_residual_mode | kvm_value_residual_mode | "linear", "rwkv", "rwkv_post_tokenshift" |
| swa_value_residual_mode | sliding_window_value_residual_mode | same values |
| use_block_lambdas | block_lambdas | x <- a * x + b * x0 before attention |
| residual_scale | residual_scale | None in research means 1.0 |
| logit_softcap | logit_softcap | 0 = off |
| use_skip_connections | - | rejected when set (no published model uses it) |
| use_l2wrap | - | rejected when set (training-only gradient trick) |
| token_mixer_class_path / alt_token_mixer_class_path | - | must be unset or the KVM/SWA mixers |
| param_dtype | torch_dtype | |
| mup_base_dim, use_overflow_v_key_weighting, use_state_deltarule, use_state_decay, gptalpha_*, ovq_*, kda_*, gated_deltanet_*, lact_* | - | not read by the KVM or SWA layers; ignored |
| (fixed) | layer_norm_eps | 1e-5, PyTorch LayerNorm default used by the research code |
"""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig
from transformers.utils import logging

# ----- version guard: this file is the first of the folder's code transformers imports -----
import transformers as _transformers

if tuple(int(part) for part in _transformers.__version__.split(".")[:2] if part.isdigit()) < (5, 17):
    raise ImportError(f"KVM models need transformers >= 5.17 (installed: {_transformers.__version__}); "
                      "upgrade with: pip install -U 'transformers>=5.17'")
# ----- end of version guard -----

logger = logging.get_logger(__name__)

STATE_BUDGET_MODES = ("fixed", "power_law", "kvm_saturation")
VALUE_RESIDUAL_MODES = ("linear", "rwkv", "rwkv_post_tokenshift")
# Fields that `from_pretrained(..., field=value)` may change: they set state size only, not weights.
BUDGET_FIELDS = (
    "state_budget_mode",
    "state_budget_factor",
    "state_budget_exponent",
    "state_budget_saturation",
    "state_budget_min",
    "state_budget_round_to",
    "state_max_chunks",
    "sink_slots",
)


def _round_down(value: int, multiple: int) -> int:
    return (max(value, 0) // max(multiple, 1)) * max(multiple, 1)


class KVMConfig(PretrainedConfig):
    """Configuration of a KVM language model: block sliding window plus key-value-means state."""

    model_type = "kvm"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 6,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        intermediate_size: int | None = None,
        layer_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rotary_dim: int | None = None,
        chunk_size: int = 256,
        window_chunks: int = 2,
        sink_slots: int = 1,
        state_budget_mode: str = "fixed",
        state_budget_min: int = 256,
        state_budget_factor: float = 1.0,
        state_budget_exponent: float = 0.5,
        state_budget_saturation: int | None = None,
        state_budget_round_to: int = 1,
        state_max_chunks: int = 1,
        merge_gate_keys: bool = True,
        merge_gate_values: bool = True,
        merge_gate_appends: bool = True,
        merge_gate_initial_state: bool = False,
        head_temperatures: bool = True,
        state_value_norms: bool = True,
        kvm_token_shift: bool = True,
        ffn_token_shift: bool = True,
        value_residual: bool = True,
        kvm_value_residual_mode: str = "rwkv",
        sliding_window_every: int = 0,
        sliding_window: int | None = None,
        sliding_window_rope_theta: float = 10000.0,
        sliding_window_rotary_dim: int | None = None,
        sliding_window_token_shift: bool = True,
        sliding_window_value_residual_mode: str = "rwkv",
        sliding_window_share_value_residual: bool = False,
        block_lambdas: bool = False,
        residual_scale: float = 1.0,
        logit_softcap: float = 0.0,
        max_position_embeddings: int = 1 << 30,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim
        self.intermediate_size = intermediate_size
        self.layer_norm_eps = layer_norm_eps
        self.rope_theta = rope_theta
        self.rotary_dim = rotary_dim
        self.chunk_size = chunk_size
        self.window_chunks = window_chunks
        self.sink_slots = sink_slots
        self.state_budget_mode = state_budget_mode
        self.state_budget_min = state_budget_min
        self.state_budget_factor = state_budget_factor
        self.state_budget_exponent = state_budget_exponent
        self.state_budget_saturation = state_budget_saturation
        self.state_budget_round_to = state_budget_round_to
        self.state_max_chunks = state_max_chunks
        self.merge_gate_keys = bool(merge_gate_keys)
        self.merge_gate_values = bool(merge_gate_values)
        self.merge_gate_appends = bool(merge_gate_appends)
        self.merge_gate_initial_state = bool(merge_gate_initial_state)
        self.head_temperatures = bool(head_temperatures)
        self.state_value_norms = bool(state_value_norms)
        self.kvm_token_shift = bool(kvm_token_shift)
        self.ffn_token_shift = bool(ffn_token_shift)
        self.value_residual = bool(value_residual)
        self.kvm_value_residual_mode = kvm_value_residual_mode
        self.sliding_window_every = sliding_window_every
        self.sliding_window = sliding_window
        self.sliding_window_rope_theta = sliding_window_rope_theta
        self.sliding_window_rotary_dim = sliding_window_rotary_dim
        self.sliding_window_token_shift = bool(sliding_window_token_shift)
        self.sliding_window_value_residual_mode = sliding_window_value_residual_mode
        self.sliding_window_share_value_residual = bool(sliding_window_share_value_residual)
        self.block_lambdas = bool(block_lambdas)
        self.residual_scale = residual_scale
        self.logit_softcap = logit_softcap
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if self.hidden_size and self.num_attention_heads:
            # None: rotate half the head, as the published models do (64 of 128). State keys keep only
            # the unrotated channels, so a whole-head rotary would leave the state unaddressable.
            self.rotary_dim = max(2, self.qk_head_dim // 4 * 2) if rotary_dim is None else rotary_dim
            self.sliding_window_rotary_dim = (
                self.qk_head_dim if sliding_window_rotary_dim is None else sliding_window_rotary_dim
            )
        self.validate_kvm()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def v_head_dim(self) -> int:
        return self.value_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or (4 * self.hidden_size) // 32 * 32

    @property
    def window_size(self) -> int:
        """Widest block sliding window of a KVM layer, in tokens."""
        return self.chunk_size * self.window_chunks

    @property
    def max_state_slots(self) -> int:
        return self.chunk_size * self.state_max_chunks

    @property
    def sliding_window_size(self) -> int:
        return self.sliding_window if self.sliding_window and self.sliding_window > 0 else self.chunk_size

    @property
    def state_stays_one_chunk(self) -> bool:
        """Whether every block is merged (no appends after the first chunk)."""
        fixed_small = self.state_budget_mode == "fixed" and self.state_budget_min <= self.chunk_size
        return self.state_max_chunks == 1 or fixed_small

    def is_sliding_window_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is a plain sliding-window layer rather than a KVM layer."""
        return self.sliding_window_every > 0 and layer_idx % self.sliding_window_every == 0

    # ---- validation ----------------------------------------------------------------------
    def validate_kvm(self) -> None:
        """Raise ValueError naming the field and the allowed values for any unsupported setting."""

        def fail(field: str, allowed: str) -> None:
            raise ValueError(f"KVMConfig.{field}={getattr(self, field)!r} is invalid: expected {allowed}.")

        def positive_int(field: str) -> None:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(field, "a positive integer")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "chunk_size", "window_chunks", "state_max_chunks", "state_budget_round_to"):
            positive_int(field)
        for field in ("head_dim", "value_head_dim", "intermediate_size"):
            if getattr(self, field) is not None:
                positive_int(field)
        if (self.head_dim is None or self.value_head_dim is None) and self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"a divisor of hidden_size={self.hidden_size} (or set head_dim and value_head_dim)")
        head = self.qk_head_dim
        if not isinstance(self.rotary_dim, int) or self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > head:
            fail("rotary_dim", f"an even integer in [2, head_dim={head}]")
        if self.rotary_dim == head:
            logger.warning_once(
                f"rotary_dim equals head_dim ({head}): state keys zero the rotary channels, so every state slot "
                "gets the same score and the state acts as a plain average. Use a smaller rotary_dim (default: half)."
            )
        if (not isinstance(self.sliding_window_rotary_dim, int) or self.sliding_window_rotary_dim < 0
                or self.sliding_window_rotary_dim % 2 or self.sliding_window_rotary_dim > head):
            fail("sliding_window_rotary_dim", f"an even integer in [0, head_dim={head}]")
        if not isinstance(self.sink_slots, int) or not 0 <= self.sink_slots < self.chunk_size:
            fail("sink_slots", f"an integer in [0, chunk_size={self.chunk_size}) so that a mergeable slot remains")
        if self.state_budget_mode not in STATE_BUDGET_MODES:
            fail("state_budget_mode", f"one of {STATE_BUDGET_MODES}")
        if not isinstance(self.state_budget_min, int) or self.state_budget_min < -1:
            fail("state_budget_min", "an integer >= -1 (-1: no appends beyond the first chunk)")
        if self.state_budget_mode == "power_law":
            if not self.state_budget_factor > 0:
                fail("state_budget_factor", "a number > 0")
            if not 0 <= self.state_budget_exponent <= 1:
                fail("state_budget_exponent", "a number in [0, 1]")
        if self.state_budget_mode == "kvm_saturation" and (
            not isinstance(self.state_budget_saturation, int) or self.state_budget_saturation < 1
        ):
            fail("state_budget_saturation", "a positive integer when state_budget_mode='kvm_saturation'")
        if not self.state_value_norms and not self.state_stays_one_chunk:
            # the research count update only has defined shapes while merged blocks and state are equal in size
            fail("state_value_norms", "True unless the state never grows past one chunk "
                 "(state_max_chunks=1, or state_budget_mode='fixed' with state_budget_min <= chunk_size)")
        for field in ("kvm_value_residual_mode", "sliding_window_value_residual_mode"):
            if getattr(self, field) not in VALUE_RESIDUAL_MODES:
                fail(field, f"one of {VALUE_RESIDUAL_MODES}")
        if not isinstance(self.sliding_window_every, int) or self.sliding_window_every < 0 or self.sliding_window_every == 1:
            fail("sliding_window_every", "0 (no sliding-window layers) or an integer >= 2")
        if self.sliding_window is not None and not isinstance(self.sliding_window, int):
            fail("sliding_window", "an integer (<= 0 or None: chunk_size)")
        if self.sliding_window_every and self.num_hidden_layers < 2:
            fail("num_hidden_layers", "at least 2 when sliding_window_every is set (layer 1 must be a KVM layer)")
        if self.value_residual and "rwkv_post_tokenshift" in (
            self.kvm_value_residual_mode, self.sliding_window_value_residual_mode
        ) and self.hidden_size != self.num_attention_heads * self.v_head_dim:
            fail("value_head_dim", "hidden_size // num_attention_heads with value residual mode 'rwkv_post_tokenshift'")
        if not self.residual_scale or self.residual_scale <= 0:
            fail("residual_scale", "a number > 0")
        if self.logit_softcap < 0:
            fail("logit_softcap", "a number >= 0 (0 disables it)")

    # ---- state budget ---------------------------------------------------------------------
    def state_budget(self, context_len: int) -> int:
        """Budget target of the state after `context_len` tokens, before the coverage cap."""
        if self.state_budget_mode == "fixed":
            target = self.state_budget_min
        elif self.state_budget_mode == "power_law":
            target = int(math.floor(self.state_budget_factor * float(max(context_len, 0)) ** self.state_budget_exponent))
            target = max(_round_down(target, self.state_budget_round_to), self.state_budget_min)
        else:
            n, t = float(self.state_budget_saturation), float(max(context_len, 0))
            target = int(math.floor(n * t / (n + t)))
            target = max(_round_down(target, self.state_budget_round_to), self.state_budget_min)
        return min(target, self.max_state_slots)

    def state_slots_after(self, num_tokens: int) -> int:
        """Closed-form state length of a KVM layer after `num_tokens` tokens (one row)."""
        chunk, window = self.chunk_size, self.window_chunks
        slots = min(num_tokens, chunk)
        if num_tokens <= window * chunk:
            return slots
        # block j >= 1 enters the state when the first token of chunk j + window arrives
        last_chunk = (num_tokens - 1) // chunk
        for block in range(1, last_chunk - window + 1):
            ctx_len = (block + window) * chunk
            desired = min(self.state_budget(ctx_len), (block + 1) * chunk)
            slots = max(slots, min(max(desired, slots), slots + chunk))
        return slots

    def window_tokens_after(self, num_tokens: int) -> int:
        """Tokens held in a KVM layer's block window after `num_tokens` tokens."""
        chunk = self.chunk_size
        end = -(-num_tokens // chunk) * chunk
        return num_tokens - max(0, end - self.window_size)

    def cache_bytes(self, num_tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes a KVMCache holds after `num_tokens` tokens (what `KVMCache.nbytes()` reports)."""
        item = torch.empty((), dtype=dtype).element_size()
        state_item = torch.empty((), dtype=state_dtype_for(dtype)).element_size()
        heads, dk, dv = self.num_attention_heads, self.qk_head_dim, self.v_head_dim
        qk, vv, hidden = heads * dk, heads * self.v_head_dim, self.hidden_size
        total = 0
        for layer_idx in range(self.num_hidden_layers):
            shift = 0
            if self.ffn_token_shift:
                shift += hidden * item
            sliding = self.is_sliding_window_layer(layer_idx)
            if self.sliding_window_token_shift if sliding else self.kvm_token_shift:
                shift += (2 * qk + vv) * item
            mode = self.sliding_window_value_residual_mode if sliding else self.kvm_value_residual_mode
            if self.value_residual and mode == "rwkv_post_tokenshift":
                shift += hidden * item
            if num_tokens <= 0:
                continue
            total += shift * batch_size
            if sliding:
                total += batch_size * heads * min(num_tokens, self.sliding_window_size) * (dk + dv) * item
                continue
            window = self.window_tokens_after(num_tokens)
            gate = 1 if self.merge_gate_keys or self.merge_gate_values else 0
            total += batch_size * heads * window * (dk + dv + gate) * item
            slots = self.state_slots_after(num_tokens)
            total += batch_size * heads * slots * ((dk + dv) * state_item + 4)
        return total

    def full_attention_cache_bytes(
        self, num_tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16
    ) -> int:
        """Bytes of a plain full-attention key/value cache of the same shape after `num_tokens`."""
        item = torch.empty((), dtype=dtype).element_size()
        per_token = self.num_attention_heads * (self.qk_head_dim + self.v_head_dim) * item
        return self.num_hidden_layers * batch_size * max(num_tokens, 0) * per_token


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """State sums accumulate many tokens: float16 would overflow and bfloat16's 8-bit mantissa drops
    each new token once a sum is large, so both keep the state in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
