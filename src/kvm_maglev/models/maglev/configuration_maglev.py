"""Configuration of Maglev (Sliding Recurrent Memory) on a nanochat GPT backbone. Where a nanochat checkpoint's
meta json gives the fields is the converter's (`convert.maglev.META_NAMES`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig

from ..common.config_fields import init_signature, store_fields
from ..common.transformers_versions import MIN_TRANSFORMERS  # noqa: F401  (first: stops a too-old transformers)

WINDOW_LETTERS = "SL"
CONSISTENCY_LOSSES = ("mse", "cosine")
MEMORY_PREFILL_MODES = ("recurrent", "prefiller")
TRAINING_FORWARDS = ("lifted", "recurrent")
WEIGHT_INITS = ("nanochat", "torch")
POSITIVE_FIELDS = ("vocab_size", "pad_vocab_size_to", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "sequence_len")


class MaglevConfig(PretrainedConfig):
    """Every nanochat GPT feature as a switch, plus the Maglev memory and prefiller fields.

    With `use_memory=False` and `sliding_window=None` the model is exactly nanochat's GPT, its per-layer windows
    taken from `window_pattern`.

    Args:
        vocab_size (`int`): tokenizer size; logits are sliced to it
        pad_vocab_size_to (`int`): embedding rows (lm_head's too when lm_head_padded) padded to a multiple of this
            (resize_token_embeddings sets 1: it gives the rows asked for)
        lm_head_padded (`bool | None`): lm_head rows padded like the embeddings (None: true for configs saved before
            this field, whose heads from_pretrained unpads; false for new ones): false gives exactly vocab_size rows, so
            a library that reads the head's weight (TRL's fused log-prob head) normalises over real ids only
        hidden_size (`int`): model width; also the memory dimension
        intermediate_size (`int | None`): relu^2 MLP width (None: 4 * hidden_size)
        num_hidden_layers (`int`): decoder layers
        num_attention_heads (`int`): attention heads; head_dim = hidden_size / num_attention_heads
        num_key_value_heads (`int | None`): key/value heads (GQA), a divisor of num_attention_heads (None:
            num_attention_heads)
        max_position_embeddings (`int`): usable context, which lm-eval and generate() read (converted models: 2**30)
        sequence_len (`int | None`): nanochat's training length: the L window; S = a quarter, rounded up to a multiple
            of 128 (None: max_position_embeddings)
        window_pattern (`str`): S/L letters per layer, repeated (the last layer is L), used when sliding_window is None
        rope_theta (`float`): rotary base
        rms_norm_eps (`float | None`): epsilon of the weightless RMSNorm (None: the dtype's epsilon, as nanochat)
        qk_norm_scale (`float`): q and k are multiplied by it after QK-norm
        logit_softcap (`float | None`): tanh soft-capping of the logits (None: off)
        use_value_embeddings (`bool`): value embeddings on alternating layers, the last included
        value_embedding_gate_channels (`int`): input channels of the value-embedding gate scale * sigmoid(W
            x[:channels]), one per KV head
        value_embedding_gate_scale (`float`): scale of the value-embedding gate
        use_smear (`bool`): mix in the previous token's embedding (smear)
        smear_gate_channels (`int`): input channels of the smear gate
        use_backout (`bool`): subtract backout_lambda x backout_layer's output before the final norm
        backout_layer (`int | None`): the layer backout subtracts (None: num_hidden_layers // 2)
        use_layer_lambdas (`bool`): per-layer resid_lambdas / x0_lambdas mixing
        use_memory (`bool`): Maglev memory injected into keys and values
        sliding_window (`int | None`): keys per query including itself, in every layer of P (required with the memory)
        memory_gate_channels (`int`): input channels of the per-KV-head memory gate
        memory_init_std (`float`): init std of the memory projections W_k, W_v
        has_prefiller (`bool`): the checkpoint carries the prefiller Q (converter: --keep-prefiller)
        prefiller_window_pattern (`str`): Q's windows, S/L letters as window_pattern
        prefiller_shares_blocks (`bool`): Q runs P's blocks (else its own prefiller_layers)
        memory_prefill (`str`): prompt processing: "recurrent" (token after token) or "prefiller" (needs Q)
        memory_source_layer (`int | None`): block whose output the memory is read from (None: the head input)
        memory_projection (`bool`): memory m = rms_norm(W_m source), a learned projection
        memory_residual_injection (`bool`): the memory also enters P's block input, through a zero-initialised
            projection
        weight_init (`str`): fresh weights: "nanochat" (its per-layer inits) or "torch" (PyTorch's layer defaults)
        initializer_range (`float`): transformers' conventional init std; the model's own init does not read it
        use_cache (`bool`): forward returns a MaglevCache
        tie_word_embeddings (`bool`): share the embedding and output weights
        pad_token_id (`int | None`): id of the padding token (None: none)
        bos_token_id (`int | None`): id of the beginning-of-sequence token (None: none)
        eos_token_id (`int | list[int] | None`): id(s) of the end-of-sequence token (None: none)

    Training args:
        consistency_weight (`float`): loss = lm_loss + consistency_weight * consistency_loss
        consistency_loss (`str`): "mse" or "cosine"
        consistency_detach_target (`bool`): stop the consistency gradient into Q's memories
        training_forward (`str`): forwards in training mode or with labels: "lifted" (lifted parallel training: Q feeds
            P, when Q is kept) or "recurrent" (P alone fed its own memory, the distribution generate() samples from:
            scoring samples, e.g. TRL's GRPO)
        memory_self_feed_steps (`int`): training: passes that feed P its own shifted memories after the prefiller-fed
            one
        memory_self_feed_detach (`bool`): training: no gradient through the fed-back memories
        memory_self_feed_mix (`float`): training: chance per position that a self-fed pass reads P's own memory rather
            than the prefiller's, in [0, 1]
        memory_self_feed_mix_ramp_steps (`int`): training: steps over which that chance ramps up from 0 (0: no ramp)
        memory_noise_std (`float`): training: Gaussian noise on the memory inputs
        consistency_weight_final (`float | None`): training: the consistency weight a linear ramp ends at (with
            consistency_weight_ramp_steps)
        consistency_weight_ramp_steps (`int`): training: steps of that ramp (0: constant weight)
        consistency_detach_target_after (`int | None`): training: from this step on Q is a frozen teacher (None: never)
        consistency_weight_after_detach (`float | None`): training: the consistency weight once Q is frozen (None:
            unchanged)
    """

    model_type = "maglev"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # transformers' name for the softcap (TRL's log-prob head reads it); one stored value, `logit_softcap`
    attribute_map = {"final_logit_softcapping": "logit_softcap"}

    # ---- fields: the architecture's and inference's, in `__init__` order (positional arguments follow it)
    vocab_size: int = 32768
    pad_vocab_size_to: int = 64
    lm_head_padded: bool | None = None
    hidden_size: int = 768
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 6
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    sequence_len: int | None = None
    window_pattern: str = "L"
    rope_theta: float = 100000.0
    rms_norm_eps: float | None = None
    qk_norm_scale: float = 1.2
    logit_softcap: float | None = 15.0
    use_value_embeddings: bool = True
    value_embedding_gate_channels: int = 12
    value_embedding_gate_scale: float = 3.0
    use_smear: bool = True
    smear_gate_channels: int = 24
    use_backout: bool = True
    backout_layer: int | None = None
    use_layer_lambdas: bool = True
    use_memory: bool = True
    sliding_window: int | None = 256
    memory_gate_channels: int = 12
    memory_init_std: float = 0.02
    has_prefiller: bool = True
    prefiller_window_pattern: str = "SSSL"
    prefiller_shares_blocks: bool = True
    memory_prefill: str = "recurrent"
    memory_source_layer: int | None = None
    memory_projection: bool = False
    memory_residual_injection: bool = False
    weight_init: str = "nanochat"
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # ---- training only (the lifted and self-fed passes, the consistency loss, their step schedules:
    # curriculum_maglev), after the others in `__init__`; inference reads none of them
    consistency_weight: float = 1.0
    consistency_loss: str = "mse"
    consistency_detach_target: bool = False
    training_forward: str = "lifted"
    memory_self_feed_steps: int = 0
    memory_self_feed_detach: bool = False
    memory_self_feed_mix: float = 1.0
    memory_self_feed_mix_ramp_steps: int = 0
    memory_noise_std: float = 0.0
    consistency_weight_final: float | None = None
    consistency_weight_ramp_steps: int = 0
    consistency_detach_target_after: int | None = None
    consistency_weight_after_detach: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The fields above by keyword or, in their order, by position; other keywords are transformers' own."""
        super().__init__(**store_fields(MaglevConfig, self, args, kwargs))

    def __post_init__(self, **kwargs) -> None:
        """The defaults that follow from other fields, then validation."""
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.sequence_len is None:
            self.sequence_len = self.max_position_embeddings
        if self.backout_layer is None:
            self.backout_layer = self.num_hidden_layers // 2
        if self.lm_head_padded is None:
            # a saved config (it carries transformers_version) from before the field has a padded head
            self.lm_head_padded = self.transformers_version is not None
        super().__post_init__(**kwargs)
        self.validate_maglev()

    # ----- validation -------------------------------------------------------------------
    def validate_maglev(self) -> None:
        """Raise a ValueError naming the field of the first invalid setting."""
        for valid, error in self.checks():
            if not valid:
                raise ValueError(error)

    def checks(self) -> Iterator[tuple[bool, str]]:
        """(whether a setting is valid, the error naming its field) for each check, in order: a check is made only
        once those before it passed, so it may rely on their fields."""
        for name in POSITIVE_FIELDS:
            value = getattr(self, name)
            yield is_int(value) and value >= 1, f"{name} must be a positive integer, got {value!r}"
        heads, kv_heads, hidden, layers = (self.num_attention_heads, self.num_key_value_heads, self.hidden_size,
                                           self.num_hidden_layers)
        yield not hidden % heads, f"num_attention_heads ({heads}) must divide hidden_size ({hidden})"
        yield not self.head_dim % 2, f"hidden_size / num_attention_heads must be even for rotary, got {self.head_dim}"
        yield not heads % kv_heads, f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
        for name in ("window_pattern", "prefiller_window_pattern"):
            pattern = getattr(self, name)
            yield (isinstance(pattern, str) and pattern and all(c in WINDOW_LETTERS for c in pattern.upper()),
                   f"{name} must be a non-empty string of the letters S and L, got {pattern!r}")
        yield not self.rope_theta <= 0, f"rope_theta must be positive, got {self.rope_theta}"
        cap = self.logit_softcap
        yield cap is None or not cap <= 0, f"logit_softcap must be positive or None, got {cap}"
        for name, used in (("value_embedding_gate_channels", self.use_value_embeddings),
                           ("smear_gate_channels", self.use_smear), ("memory_gate_channels", self.use_memory)):
            channels = getattr(self, name)
            yield not used or 1 <= channels <= hidden, f"{name} must be in [1, hidden_size={hidden}], got {channels}"
        yield (not self.use_backout or 0 <= self.backout_layer < layers,
               f"backout_layer must be in [0, num_hidden_layers={layers}), got {self.backout_layer}")
        window = self.sliding_window
        yield (window is None or (isinstance(window, int) and not window < 2),
               f"sliding_window must be an integer >= 2 (keys including the current token) or None, got {window!r}")
        yield not (self.use_memory and window is None), "sliding_window must be set when use_memory is true"
        loss = self.consistency_loss
        yield loss in CONSISTENCY_LOSSES, f"consistency_loss must be one of {CONSISTENCY_LOSSES}, got {loss!r}"
        yield not self.consistency_weight < 0, f"consistency_weight must be >= 0, got {self.consistency_weight}"
        for name, allowed in (("memory_prefill", MEMORY_PREFILL_MODES), ("training_forward", TRAINING_FORWARDS)):
            yield getattr(self, name) in allowed, f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
        yield (self.memory_prefill != "prefiller" or (self.use_memory and self.has_prefiller),
               "memory_prefill='prefiller' needs use_memory=true and the prefiller's weights (has_prefiller=true); "
               "convert with --keep-prefiller")
        yield from self.memory_training_checks()

    def memory_training_checks(self) -> Iterator[tuple[bool, str]]:
        """`checks` of the memory's shape switches and the training switches that close the exposure gap."""
        layer, layers = self.memory_source_layer, self.num_hidden_layers
        yield (layer is None or (is_int(layer) and 0 <= layer < layers),
               f"memory_source_layer must be None or in [0, num_hidden_layers={layers}), got {layer!r}")
        for name in ("memory_self_feed_steps", "memory_self_feed_mix_ramp_steps", "consistency_weight_ramp_steps"):
            value = getattr(self, name)
            yield is_int(value) and not value < 0, f"{name} must be an integer >= 0, got {value!r}"
        mix = self.memory_self_feed_mix
        yield 0.0 <= mix <= 1.0, f"memory_self_feed_mix must be in [0, 1], got {mix}"
        yield not self.memory_noise_std < 0, f"memory_noise_std must be >= 0, got {self.memory_noise_std}"
        for name in ("consistency_weight_final", "consistency_weight_after_detach"):
            value = getattr(self, name)
            yield value is None or not value < 0, f"{name} must be None or >= 0, got {value}"
        final, ramp = self.consistency_weight_final, self.consistency_weight_ramp_steps
        yield ((final is None) == (ramp == 0), "consistency_weight_final and consistency_weight_ramp_steps go "
               f"together (a linear ramp), got {final!r} and {ramp!r}")
        after = self.consistency_detach_target_after
        yield (after is None or (is_int(after) and not after < 0),
               f"consistency_detach_target_after must be None or an integer >= 0, got {after!r}")
        yield self.weight_init in WEIGHT_INITS, f"weight_init must be one of {WEIGHT_INITS}, got {self.weight_init!r}"
        yield (self.use_memory or not (self.memory_projection or self.memory_residual_injection
                                       or self.memory_self_feed_steps),
               "memory_projection, memory_residual_injection and memory_self_feed_steps need use_memory=true")

    # ----- derived sizes ------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and lm_head tables (nanochat pads for efficiency)."""
        return math.ceil(self.vocab_size / self.pad_vocab_size_to) * self.pad_vocab_size_to

    @property
    def head_rows(self) -> int:
        """Rows of lm_head: vocab_size, or the padded rows of a head saved before `lm_head_padded` existed."""
        return self.padded_vocab_size if self.lm_head_padded else self.vocab_size

    @property
    def embedding_rows(self) -> int:
        """Rows of embed_tokens: padded, except when tied to an unpadded head (one table)."""
        return self.head_rows if self.tie_word_embeddings else self.padded_vocab_size

    @property
    def separate_prefiller(self) -> bool:
        """Whether the prefiller Q has blocks of its own (`prefiller_layers`) rather than running P's."""
        return self.use_memory and self.has_prefiller and not self.prefiller_shares_blocks

    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun): attention split by head (K/V
    # heads with their query groups), the memory projections and gates with the K/V heads they feed, the MLP
    # by hidden unit; the value-embedding tables stay whole and each rank reads its heads' columns.
    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The plan for the modules this config builds only (transformers checks that every entry names some)."""
        styles = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                  "self_attn.o_proj": "rowwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
        if self.use_value_embeddings:
            styles["self_attn.value_gate"] = "colwise"
        blocks = ("layers", "prefiller_layers") if self.separate_prefiller else ("layers",)
        plan = {f"{block}.*.{name}": style for block in blocks for name, style in styles.items()}
        if self.use_memory:
            plan.update({f"layers.*.self_attn.{name}": "colwise"
                         for name in ("memory_k_proj", "memory_v_proj", "memory_gate")})
        if self.tie_word_embeddings:  # the vocabulary-sharded table the tied head shares (transformers' rule)
            plan["embed_tokens"] = "embedding_rowwise"
        return plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str]) -> None:
        # transformers < 5.24 writes the tied-embedding entry back into the config at init; the plan is derived
        # from the other fields, so only that same plan can be stored.
        if plan != self.base_model_tp_plan:
            raise AttributeError("MaglevConfig.base_model_tp_plan is computed from the fields that choose which "
                                 "modules exist; set those fields instead")

    def has_value_embedding(self, layer_idx: int) -> bool:
        """nanochat puts value embeddings on alternating layers, the last one always included."""
        return self.use_value_embeddings and layer_idx % 2 == (self.num_hidden_layers - 1) % 2

    def pattern_windows(self, pattern: str) -> list[int]:
        """Per-layer `left` context (keys before the current one) for a nanochat window pattern (`sequence_len`
        describes L and S); the last layer is always L."""
        long_window = self.sequence_len
        short_window = -(-long_window // 4 // 128) * 128
        letters = pattern.upper()
        windows = [long_window if letters[i % len(letters)] == "L" else short_window
                   for i in range(self.num_hidden_layers)]
        windows[-1] = long_window
        return windows

    @property
    def decoder_windows(self) -> list[int]:
        """Left context per layer of the decoder P: `sliding_window - 1` everywhere when set."""
        if self.sliding_window is not None:
            return [self.sliding_window - 1] * self.num_hidden_layers
        return self.pattern_windows(self.window_pattern)

    @property
    def prefiller_windows(self) -> list[int]:
        return self.pattern_windows(self.prefiller_window_pattern)


MaglevConfig.__init__.__signature__ = init_signature(MaglevConfig)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
