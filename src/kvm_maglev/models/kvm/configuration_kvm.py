"""KVM (Key-Value Means) model configuration. The fields' names in the research code (github recursal/KVM-paper)
are the converter's (`convert.kvm.RESEARCH_NAMES`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig
from transformers.utils import logging

from ..common.config_fields import init_signature, store_fields
from ..common.transformers_versions import MIN_TRANSFORMERS  # noqa: F401  (first: stops a too-old transformers)

logger = logging.get_logger(__name__)


STATE_BUDGET_MODES = ("fixed", "power_law", "kvm_saturation")
VALUE_RESIDUAL_MODES = ("linear", "rwkv", "rwkv_post_tokenshift")
MERGE_ROUTING_DTYPES = ("float32", "model")
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "chunk_size",
                   "window_chunks", "state_max_chunks", "state_budget_round_to")
# Switch fields stored as bools: research YAML gives them as 0/1.
SWITCHES = ("merge_gate_keys", "merge_gate_values", "merge_gate_appends", "merge_gate_initial_state",
            "head_temperatures", "state_value_norms", "kvm_token_shift", "ffn_token_shift", "value_residual",
            "sliding_window_token_shift", "sliding_window_share_value_residual", "block_lambdas")
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


class KVMConfig(PretrainedConfig):
    """Configuration of a KVM language model: block sliding window plus key-value-means state.

    Args:
        vocab_size (`int`): tokenizer size
        hidden_size (`int`): model width
        num_hidden_layers (`int`): decoder layers
        num_attention_heads (`int`): attention heads
        num_key_value_heads (`int | None`): key/value heads (grouped-query attention): the window, the state, its merges
            and the merge gate are kept per key/value head, query head h reads key/value head h // (num_attention_heads
            // num_key_value_heads) (None: one per query head)
        head_dim (`int | None`): query/key channels per head (None: hidden_size // num_attention_heads)
        value_head_dim (`int | None`): value channels per head (None: hidden_size // num_attention_heads)
        intermediate_size (`int | None`): MLP width; converted: int(ffn_expansion * hidden_size) // 32 * 32 (None: 4 *
            hidden_size, rounded down to a multiple of 32)
        layer_norm_eps (`float`): LayerNorm epsilon: PyTorch's default, as the research code uses
        rope_theta (`float`): rotary base of the KVM layers
        rotary_dim (`int | None`): rotated channels of a head in KVM layers, zeroed in state keys; the whole head leaves
            state keys all zero (warned) (None: half the head; research: 64 of 128)
        chunk_size (`int`): tokens per chunk: the window slides and the state merges a chunk at a time
        window_chunks (`int`): chunk-aligned blocks in the sliding window
        sink_slots (`int`): state slots never merged into
        state_budget_mode (`str`): how the state grows: "fixed", "power_law" or "kvm_saturation"
        state_budget_min (`int`): fixed: the budget; others: the floor (-1: no appends after the first chunk)
        state_budget_factor (`float`): power_law: budget = factor * N ** exponent
        state_budget_exponent (`float`): power_law: the exponent, in [0, 1]
        state_budget_saturation (`int | None`): kvm_saturation: budget = n * N / (n + N)
        state_budget_round_to (`int`): budget rounded down to a multiple of this
        state_max_chunks (`int`): state cap = chunk_size * state_max_chunks
        merge_gate_keys (`bool`): scale merged keys by 1 + elu(W x)
        merge_gate_values (`bool`): scale merged values by the gate
        merge_gate_appends (`bool`): appended slots gated too
        merge_gate_initial_state (`bool`): first chunk gated too
        merge_routing_dtype (`str`): dtype the merge routing (each token's most similar slot) is scored in: "float32"
            (or the state's finer dtype; research kvm_fp32_routing_reference, and this model's state under half
            precision) or "model" (keys rounded to the model dtype, as the research kvm_mixer scores them in bfloat16)
        head_temperatures (`bool`): per-head window/state key scales
        state_value_norms (`bool`): True: renormalise merged values to the slot norm; False: divide by counts (research:
            +1 on every slot per merged block; only with a one-chunk state)
        kvm_token_shift (`bool`): token shift of q/k/v in KVM layers
        ffn_token_shift (`bool`): token shift before the MLP
        value_residual (`bool`): mix each layer's values with an anchor from the first layer
        kvm_value_residual_mode (`str`): how, in KVM layers: "linear", "rwkv" or "rwkv_post_tokenshift"
        sliding_window_every (`int`): layers with index % n == 0 are sliding-window layers; 0: none
        sliding_window (`int | None`): keys of a sliding-window layer (<= 0 or None: chunk_size)
        sliding_window_rope_theta (`float`): rotary base of the sliding-window layers
        sliding_window_rotary_dim (`int | None`): rotated channels of a head in sliding-window layers, 0: no rotary
            (None: the whole head)
        sliding_window_token_shift (`bool`): token shift of q/k/v in sliding-window layers
        sliding_window_value_residual_mode (`str`): kvm_value_residual_mode of the sliding-window layers
        sliding_window_share_value_residual (`bool`): KVM layers use the first sliding-window layer's value anchor
        block_lambdas (`bool`): x <- a * x + b * x0 before attention
        residual_scale (`float`): scale of each residual branch (research None: 1.0)
        logit_softcap (`float`): tanh soft-capping of the logits; 0: off
        max_position_embeddings (`int`): usable context: windows and a bounded state keep the cost per token flat at any
            length
        tie_word_embeddings (`bool`): share the embedding and output weights
        use_cache (`bool`): forward returns a KVMCache
        pad_token_id (`int | None`): id of the padding token (None: none)
        bos_token_id (`int | None`): id of the beginning-of-sequence token (None: none)
        eos_token_id (`int | list[int] | None`): id(s) of the end-of-sequence token (None: none)
    """

    model_type = "kvm"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (`tp_plan="auto"`): attention split by key/value head, each rank keeping its heads' window
    # and state with the query heads that read them, the per-head parameters with them; the MLP by hidden unit.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.value_gate_up": "colwise",
        "layers.*.self_attn.merge_gate_proj": "colwise",
        "layers.*.self_attn.q_shift": "colwise",
        "layers.*.self_attn.k_shift": "colwise",
        "layers.*.self_attn.v_shift": "colwise",
        "layers.*.self_attn.window_temperature": "colwise",
        "layers.*.self_attn.state_temperature": "colwise",
        "layers.*.self_attn.value_gate_bias": "rowwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    # ---- fields, in `__init__` order (positional arguments follow it)
    vocab_size: int = 50304
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    intermediate_size: int | None = None
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_dim: int | None = None
    chunk_size: int = 256
    window_chunks: int = 2
    sink_slots: int = 1
    state_budget_mode: str = "fixed"
    state_budget_min: int = 256
    state_budget_factor: float = 1.0
    state_budget_exponent: float = 0.5
    state_budget_saturation: int | None = None
    state_budget_round_to: int = 1
    state_max_chunks: int = 1
    merge_gate_keys: bool = True
    merge_gate_values: bool = True
    merge_gate_appends: bool = True
    merge_gate_initial_state: bool = False
    merge_routing_dtype: str = "float32"
    head_temperatures: bool = True
    state_value_norms: bool = True
    kvm_token_shift: bool = True
    ffn_token_shift: bool = True
    value_residual: bool = True
    kvm_value_residual_mode: str = "rwkv"
    sliding_window_every: int = 0
    sliding_window: int | None = None
    sliding_window_rope_theta: float = 10000.0
    sliding_window_rotary_dim: int | None = None
    sliding_window_token_shift: bool = True
    sliding_window_value_residual_mode: str = "rwkv"
    sliding_window_share_value_residual: bool = False
    block_lambdas: bool = False
    residual_scale: float = 1.0
    logit_softcap: float = 0.0
    max_position_embeddings: int = 1 << 30
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The fields above by keyword or, in their order, by position; other keywords are transformers' own."""
        super().__init__(**store_fields(KVMConfig, self, args, kwargs))

    def __post_init__(self, **kwargs) -> None:
        """The switches as bools, the defaults that follow from other fields, then validation."""
        for name in SWITCHES:
            setattr(self, name, bool(getattr(self, name)))
        super().__post_init__(**kwargs)
        if self.hidden_size and self.num_attention_heads:
            # None: rotate half the head, as the published models do (64 of 128). State keys keep only
            # the unrotated channels, so a whole-head rotary would leave the state unaddressable.
            if self.rotary_dim is None:
                self.rotary_dim = max(2, self.qk_head_dim // 4 * 2)
            if self.sliding_window_rotary_dim is None:
                self.sliding_window_rotary_dim = self.qk_head_dim
            # None: one key/value head per query head, written out as transformers' models do (PEFT and
            # other libraries multiply by it).
            if self.num_key_value_heads is None:
                self.num_key_value_heads = self.num_attention_heads
        self.validate_kvm()

    # transformers' name for the softcap, which TRL's fused log-prob head reads: None there means off, where
    # `logit_softcap` (the research field, stored) uses 0; TRL would read a 0 as a cap of 1.
    @property
    def final_logit_softcapping(self) -> float | None:
        """The logit softcap under transformers' name: `logit_softcap`, None when it is 0 (off)."""
        return self.logit_softcap or None

    @final_logit_softcapping.setter
    def final_logit_softcapping(self, value: float | None) -> None:
        self.logit_softcap = 0.0 if value is None else float(value)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: the window and the state are kept per key/value head."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def kv_group_size(self) -> int:
        """Query heads reading each key/value head."""
        return self.num_attention_heads // self.kv_heads

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
        """Raise ValueError naming the field and the allowed values for the first unsupported setting."""
        for field, valid, allowed in self.checks():
            if not valid:
                raise ValueError(f"KVMConfig.{field}={getattr(self, field)!r} is invalid: expected {allowed}.")
            if field == "rotary_dim" and self.rotary_dim == self.qk_head_dim:
                logger.warning_once(
                    f"rotary_dim equals head_dim ({self.qk_head_dim}): state keys zero the rotary channels, so every "
                    "state slot gets the same score and the state acts as a plain average. Use a smaller rotary_dim "
                    "(default: half).")

    def checks(self) -> Iterator[tuple[str, bool, str]]:
        """(field, whether its value is valid, what is allowed) for each check, in order: a check is made only once
        those before it passed, so it may rely on their fields."""
        heads, kv, post_shift = self.num_attention_heads, self.num_key_value_heads, "rwkv_post_tokenshift"
        for name in POSITIVE_FIELDS:
            yield name, is_positive_int(getattr(self, name)), "a positive integer"
        for name in ("head_dim", "value_head_dim", "intermediate_size"):
            yield name, getattr(self, name) is None or is_positive_int(getattr(self, name)), "a positive integer"
        yield ("num_attention_heads", (self.head_dim and self.value_head_dim) or not self.hidden_size % heads,
               f"a divisor of hidden_size={self.hidden_size} (or set head_dim and value_head_dim)")
        yield ("num_key_value_heads", kv is None or (is_positive_int(kv) and not heads % kv),
               f"None or a positive divisor of num_attention_heads={heads}")
        grouped = kv is not None and kv != heads
        # the research sliding-window mixer keeps one key/value head per query head
        yield ("num_key_value_heads", not (grouped and self.sliding_window_every),
               "None (or num_attention_heads) when sliding_window_every is set: sliding-window layers have no "
               "grouped-query attention")
        yield ("num_key_value_heads", not (grouped and self.value_residual and self.kvm_value_residual_mode == post_shift),
               f"None (or num_attention_heads) with kvm_value_residual_mode '{post_shift}' (not supported with "
               "grouped-query attention)")
        head = self.qk_head_dim
        yield "rotary_dim", is_even_int(self.rotary_dim, 2, head), f"an even integer in [2, head_dim={head}]"
        yield ("sliding_window_rotary_dim", is_even_int(self.sliding_window_rotary_dim, 0, head),
               f"an even integer in [0, head_dim={head}]")
        yield ("sink_slots", isinstance(self.sink_slots, int) and 0 <= self.sink_slots < self.chunk_size,
               f"an integer in [0, chunk_size={self.chunk_size}) so that a mergeable slot remains")
        yield "merge_routing_dtype", self.merge_routing_dtype in MERGE_ROUTING_DTYPES, f"one of {MERGE_ROUTING_DTYPES}"
        yield "state_budget_mode", self.state_budget_mode in STATE_BUDGET_MODES, f"one of {STATE_BUDGET_MODES}"
        yield ("state_budget_min", isinstance(self.state_budget_min, int) and self.state_budget_min >= -1,
               "an integer >= -1 (-1: no appends beyond the first chunk)")
        power_law = self.state_budget_mode == "power_law"
        yield "state_budget_factor", not power_law or self.state_budget_factor > 0, "a number > 0"
        yield "state_budget_exponent", not power_law or 0 <= self.state_budget_exponent <= 1, "a number in [0, 1]"
        saturation = self.state_budget_saturation
        yield ("state_budget_saturation", self.state_budget_mode != "kvm_saturation"
               or (isinstance(saturation, int) and saturation >= 1),
               "a positive integer when state_budget_mode='kvm_saturation'")
        # the research count update only has defined shapes while merged blocks and state are equal in size
        yield ("state_value_norms", self.state_value_norms or self.state_stays_one_chunk,
               "True unless the state never grows past one chunk (state_max_chunks=1, or state_budget_mode='fixed' "
               "with state_budget_min <= chunk_size)")
        for name in ("kvm_value_residual_mode", "sliding_window_value_residual_mode"):
            yield name, getattr(self, name) in VALUE_RESIDUAL_MODES, f"one of {VALUE_RESIDUAL_MODES}"
        every = self.sliding_window_every
        yield ("sliding_window_every", isinstance(every, int) and every >= 0 and every != 1,
               "0 (no sliding-window layers) or an integer >= 2")
        yield ("sliding_window", self.sliding_window is None or isinstance(self.sliding_window, int),
               "an integer (<= 0 or None: chunk_size)")
        yield ("num_hidden_layers", not every or self.num_hidden_layers >= 2,
               "at least 2 when sliding_window_every is set (layer 1 must be a KVM layer)")
        post_shifted = post_shift in (self.kvm_value_residual_mode, self.sliding_window_value_residual_mode)
        yield ("value_head_dim", not (self.value_residual and post_shifted) or self.hidden_size == heads * self.v_head_dim,
               f"hidden_size // num_attention_heads with value residual mode '{post_shift}'")
        yield "residual_scale", bool(self.residual_scale) and not self.residual_scale <= 0, "a number > 0"
        yield "logit_softcap", not self.logit_softcap < 0, "a number >= 0 (0 disables it)"


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_even_int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and low <= value <= high and not value % 2


KVMConfig.__init__.__signature__ = init_signature(KVMConfig)
