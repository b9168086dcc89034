"""KVM (Key-Value Means) language model for transformers.

Each KVM layer attends, in one softmax, to a block sliding window (the last
`window_chunks` chunk-aligned blocks, causal inside) and to a compressed state of
key/value slots. A block leaving the window updates the state: its most novel tokens are
appended while the state is below its budget, the rest are merged winner-take-all into
their most similar slot. Optional layers in between are plain sliding-window attention.
The full forward and cached decoding run the same chunk loop, so they agree.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple, logging

from ..common.conventions import (
    FullPrecisionLinear,
    HeadLossMixin,
    QuantizedLoadMixin,
    SdpaOrEagerMixin,
    check_position_ids,
    config_default,
    full_precision_modules,
    refuse_attention_weights,
)
from ..common.generation_cache import CachedDecodingSaveMixin, OwnCacheGenerationMixin
from ..common.model_inputs import check_cache, check_token_ids, take_cache
from ..common.seams import package_speedups, speedups_block
from ..common.step_plan import (
    RowTokens,
    Step,
    boundary_kwargs,
    bucket_index,
    gather_bucket,
    length_buckets,
    packed_documents,
    query_positions,
    real_tokens,
    refuse_packed_cache,
    scatter_outputs,
)
from ..common.tensor_parallel import full_tensor, local_tensor
from ..common.transformers_versions import CACHE_NAME, GENERATE_CACHE_KWARG
from .cache_kvm import READ, STATE, WINDOW, KVMCache, fit_slots
from .configuration_kvm import KVMConfig
from .decode_attention_kvm import at_least_float32, decoding_attention
from .decode_step_kvm import DecodeStep, decode_step, rows_folding
from .state_kvm import block_fold, readable_state, run_fold, slot_norms, state_dtype_for, state_keys
from .step_plan_kvm import (
    Pieces,
    PromptStep,
    StateSchedule,
    chunk_pieces,
    ring_positions,
    sliding_pieces,
    state_schedule,
)

logger = logging.get_logger(__name__)

# the seam of the merged attention of prompt pieces (speedups/merged_attention_kvm): the module where the package's
# speed-ups are, else None and the fused kernel runs over the key sets joined
merged_attention_kvm = package_speedups("merged_attention_kvm")


# ---- small math helpers --------------------------------------------------------------------
# why the models refuse what transformers offers for plain attention
KVM_NO_KERNELS = "one softmax spans a compressed key-value state and a block window; flash, flex and paged kernels take neither"
KVM_NO_WEIGHTS = ("KVM models return no attention weights: a query's softmax spans merged state slots and a block "
                  "window, which no [batch, heads, query, key] tensor over the tokens describes")


def rotary_tables(
    positions: torch.Tensor, rotary_dim: int, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 cos/sin [..., T, head_dim] for adjacent-pair rotary on the first `rotary_dim` channels.

    Frequencies run from 1 to 1/theta over the pairs (endpoints included) as in the research
    code; the sign of the paired term is folded into `sin`. None when nothing rotates.
    """
    if rotary_dim == 0:
        return None
    freqs = (1.0 / theta) ** torch.linspace(0.0, 1.0, rotary_dim // 2, dtype=torch.float32, device=positions.device)
    freqs = torch.cat([freqs.repeat_interleave(2), freqs.new_zeros(head_dim - rotary_dim)])
    angles = positions.float().unsqueeze(-1) * freqs
    sin = angles.sin()
    sin[..., 1::2] *= -1
    return angles.cos(), sin


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Rotate adjacent channel pairs of x [N, H, D] (one row of tables [N, D] per token)."""
    if tables is None:
        return x
    cos, sin = (t.to(x.dtype).unsqueeze(1) for t in tables)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return cos * x + sin * swapped


def value_residual_rank(hidden_size: int) -> int:
    return max(32, int(round(1.3 * hidden_size**0.5 / 32) * 32))


# ---- the joint softmax over state and window -----------------------------------------------------------
# Piece attention runs in blocks of pieces so that its logits stay under this many elements.
ATTENTION_BLOCK = 1 << 25


class KeySet(NamedTuple):
    """Keys [P, Hkv, K, D] and values [P, Hkv, K, Dv] one softmax spans for each piece, which query sees which key
    (`visible` [P, Q or 1, K]), and the per-query-head temperature [H] its logits take (None: none). `causal`: the
    keys are the piece's own queries' tokens, query i seeing keys 0..i (`visible` is that lower triangle)."""

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor
    temperature: torch.Tensor | None
    causal: bool = False


def grouped_queries(q: torch.Tensor, groups: int, temperature: torch.Tensor | None) -> torch.Tensor:
    """Pieces' queries [P, Q, H, D] as [P, Hkv, groups * Q, D] (the query heads of each key/value head together,
    query head h reading key/value head h // groups), each head scaled by its `temperature`."""
    pieces, width, heads, dim = q.shape
    q = q.view(pieces, width, heads // groups, groups, dim).permute(0, 2, 3, 1, 4)
    if temperature is not None:
        q = q * temperature.view(1, heads // groups, groups, 1, 1).to(q.dtype)
    return q.reshape(pieces, heads // groups, groups * width, dim)


# Attention runs in at least float32 (`at_least_float32`): half-precision queries, keys and values are widened, so
# that the explicit products, the fused kernel and the decoding step's attention, and so cached steps and whole
# prompts, round alike.
def joint_attention(q: torch.Tensor, key_sets: list[KeySet], groups: int, scale: float) -> torch.Tensor:
    """One softmax per query over every key set, as explicit products: queries [P, Q, H, D], output
    [P, Q, H, Dv] (in the values' dtype)."""
    pieces, width, heads, _ = q.shape
    kv_heads = heads // groups
    scaled, logits = {}, []
    for keys, _, visible, temperature, _ in key_sets:
        if id(temperature) not in scaled:  # the window's key sets share their queries
            scaled[id(temperature)] = grouped_queries(at_least_float32(q), groups, temperature)
        scores = torch.matmul(scaled[id(temperature)], at_least_float32(keys).transpose(-1, -2))
        scores = scores.view(pieces, kv_heads, groups, width, -1).masked_fill(~visible[:, None, None], float("-inf"))
        logits.append(scores.view(pieces, kv_heads, groups * width, -1))
    probs = torch.softmax(torch.cat(logits, dim=-1) * scale, dim=-1)
    out, begin = None, 0
    for keys, values, *_ in key_sets:
        part = torch.matmul(probs[..., begin:begin + keys.shape[2]], at_least_float32(values))
        out, begin = part if out is None else out + part, begin + keys.shape[2]
    out = out.to(key_sets[-1].values.dtype).view(pieces, kv_heads, groups, width, -1)
    return out.permute(0, 3, 1, 2, 4).reshape(pieces, width, heads, -1)


def fused_attention(q: torch.Tensor, key_sets: list[KeySet], groups: int) -> torch.Tensor:
    """`joint_attention` through torch's fused kernel: the key sets' keys (scaled by their temperatures, per query
    head) and values concatenated, one boolean mask. Queries [P, Q, H, D], output [P, Q, H, Dv]."""
    width = q.shape[1]
    keys, values = [], []
    for set_keys, set_values, _, temperature, _ in key_sets:
        set_keys, set_values = at_least_float32(set_keys), at_least_float32(set_values)
        if groups > 1:
            set_keys, set_values = set_keys.repeat_interleave(groups, 1), set_values.repeat_interleave(groups, 1)
        if temperature is not None:
            set_keys = set_keys * temperature.view(1, -1, 1, 1).to(set_keys.dtype)
        keys.append(set_keys)
        values.append(set_values)
    mask = torch.cat([key_set.visible.expand(-1, width, -1) for key_set in key_sets], dim=-1)[:, None]
    out = F.scaled_dot_product_attention(at_least_float32(q).transpose(1, 2), torch.cat(keys, dim=2),
                                         torch.cat(values, dim=2), attn_mask=mask)
    return out.transpose(1, 2).to(key_sets[-1].values.dtype)


def attend_pieces(q: torch.Tensor, key_sets: list[KeySet], groups: int, eager: bool,
                  merged: bool = False) -> torch.Tensor:
    """Every piece's queries [P, Q, H, D] over its key sets, in blocks of pieces (memory stays bounded for long
    prompts): the explicit products (`eager`, or one query per piece) or the fused kernel; with `merged`, a flash
    call per key set merged by log-sum-exp where that speed-up runs (speedups/merged_attention_kvm)."""
    def attend(q, key_sets):
        if eager or q.shape[1] == 1:
            return joint_attention(q, key_sets, groups, 1.0 / math.sqrt(q.shape[-1]))
        if merged and merged_attention_kvm is not None and merged_attention_kvm.applies(q, key_sets):
            return merged_attention_kvm.attend_key_sets(q, key_sets, groups)
        return fused_attention(q, key_sets, groups)

    pieces = q.shape[0]
    if not pieces:  # every row pads this forward
        return key_sets[-1].values.new_zeros(*q.shape[:3], key_sets[-1].values.shape[-1])
    per_piece = q.shape[1] * q.shape[2] * sum(key_set.keys.shape[2] for key_set in key_sets)
    block = max(1, ATTENTION_BLOCK // max(1, per_piece))
    if pieces <= block:
        return attend(q, key_sets)
    sliced = ("keys", "values", "visible")
    return torch.cat([attend(q[begin:begin + block],
                             [key_set._replace(**{name: getattr(key_set, name)[begin:begin + block] for name in sliced})
                              for key_set in key_sets])
                      for begin in range(0, pieces, block)])


def gathered(y: torch.Tensor | None, out: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    """The flat tokens' outputs [N, H, Dv] with the pieces' outputs [P, Q, H, Dv] in place: the pieces' own
    when they are all the tokens (`y` None), else written into `y` at their tokens."""
    out = out.flatten(0, 1)[pieces.order]
    if y is None:
        return out
    y[pieces.tokens] = out
    return y


def cached_ring(cache_layer, names: tuple[str, ...], pieces: Pieces, slots: int) -> list[torch.Tensor]:
    """The layer's cached window tensors `names` for each piece's row, their first `slots` slots [P, Hkv, slots, d]
    (views of the storage itself when the pieces are the rows)."""
    rows = None if pieces.identity_rows else pieces.row
    return [cache_layer.read(name, rows, slots) for name in names]


def write_ring(cache_layer, tokens: RowTokens, names: tuple[str, ...], tensors: list[torch.Tensor]) -> None:
    """Each row's newest tokens (flat [N, Hkv, d] tensors) into its window ring: position p in slot p % size."""
    size = cache_layer.ring_size

    def build():
        rows, flat = [], []
        for row, (offset, count) in enumerate(zip(tokens.offsets, tokens.counts)):
            kept = min(count, size)
            rows += [row] * kept
            flat += range(offset + count - kept, offset + count)
        flat = torch.tensor(flat, dtype=torch.long, device=tokens.device)
        return torch.tensor(rows, dtype=torch.long, device=tokens.device), flat, tokens.position[flat] % size
    rows, flat, slots = tokens.once(("ring writes", size), build)
    for name, tensor in zip(names, tensors):
        cache_layer.ensure(name, tokens.batch, (tensor.shape[1], size, tensor.shape[2]), tensor.dtype, tensor.device)
        cache_layer.write(name, rows, tensor[flat].detach(), slots)
    if cache_layer.record is not None:
        cache_layer.record.inputs = tuple(t.detach() for t in tensors) + (None,) * (3 - len(tensors))


def window_key_sets(k, v, tokens: RowTokens, pieces: Pieces, cache_layer, names,
                    temperature: torch.Tensor | None) -> list[KeySet]:
    """The window key sets of the pieces, with which query sees which key: the layer's cached ring of each piece's
    row (when a row has read tokens before), this forward's tokens before each piece's first query, and the
    piece's own tokens (each query its own and the earlier ones)."""
    key_sets = []
    # the queries of a KVM layer's piece share their lowest visible position: one mask row a piece
    low = pieces.query_low[:, :1, None] if pieces.sliding is None else pieces.query_low[:, :, None]
    if pieces.reads_ring:
        # position p sits in slot p % size: while every row has read fewer tokens than the ring holds, only the
        # slots below the longest row's count were written
        size = cache_layer.ring_size
        slots = min(size, max(tokens.starts[row] for row in set(pieces.rows)))
        keys, values = cached_ring(cache_layer, names[:2], pieces, slots)
        held = ring_positions(tokens.start[pieces.row], size)[:, None, :slots]
        key_sets.append(KeySet(keys.to(k.dtype), values.to(v.dtype), (held >= 0) & (held >= low), temperature))
    earlier, visible, causal = tokens.once(("window key sets", id(pieces)), lambda: split_window(tokens, pieces, low))
    if earlier > 0:
        index = pieces.new_index[:, :earlier]
        key_sets.append(KeySet(k[index].transpose(1, 2), v[index].transpose(1, 2), visible, temperature))
    key_sets.append(KeySet(k[pieces.query_index].transpose(1, 2), v[pieces.query_index].transpose(1, 2), causal,
                           temperature, causal=True))
    return key_sets


def split_window(tokens: RowTokens, pieces: Pieces, low: torch.Tensor) -> tuple[int, torch.Tensor | None,
                                                                              torch.Tensor]:
    """How the pieces' keys of this forward split (made once a forward, shared by the layers): how many come before
    a piece's first query at most (a piece's keys start at its lowest visible position of its row, `cut_pieces`),
    which of those each query sees, and the lower triangle of its own tokens."""
    earlier = max([first - max(lowest, tokens.starts[row]) for row, first, _, lowest in pieces.spans] or [0])
    visible = None
    if earlier > 0:
        position = pieces.new_pos[:, None, :earlier]
        visible = (position >= 0) & (position >= low) & (position < pieces.query_pos[:, :1, None])
    width = pieces.query_index.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril().expand(pieces.count, -1, -1)
    return earlier, visible, causal


# ---- attention -----------------------------------------------------------------------------
def check_tensor_parallel_size(config: KVMConfig, tp_size: int) -> None:
    """Raise ValueError when a tensor-parallel size would split a key/value head from its query heads (the plan,
    `KVMConfig.base_model_tp_plan`, splits attention by head; the layers read their part with `local_tensor`)."""
    if tp_size < 1 or config.kv_heads % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide num_key_value_heads={config.kv_heads}: "
                         "each rank must hold whole key/value heads, each with its own state and window, "
                         "and the query heads that read them; use a divisor of num_key_value_heads")


def zero_initialised(linear: nn.Linear) -> nn.Linear:
    """Tag an output projection that starts at zero. `_init_weights` reads the tag on the layer itself:
    transformers skips remote-code containers that own no parameters directly, never a layer that does."""
    linear.init_kind = "zeros"
    return linear


class KVMAttentionBase(nn.Module):
    """q/k/v projections with per-head layer norm, optional token shift and value residual."""

    # Set by a runtime that takes the seam's merged attention (the vLLM plugin): prompt pieces attend each key set
    # in its own flash call, merged by log-sum-exp (`attend_pieces`); False keeps the key sets joined in one fused
    # call, the reference it equals up to float rounding.
    merged_key_sets = False

    def __init__(self, config: KVMConfig, layer_idx: int, token_shift_on: bool, value_residual_mode: str):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.kv_heads
        self.groups = config.kv_group_size  # query heads per key/value head
        self.head_dim = config.qk_head_dim
        self.value_head_dim = config.v_head_dim
        qk, kk, vv = (self.num_heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.value_head_dim)
        self.q_proj = nn.Linear(config.hidden_size, qk, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kk, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, vv, bias=False)
        self.o_proj = zero_initialised(nn.Linear(self.num_heads * self.value_head_dim, config.hidden_size,
                                                    bias=False))
        self.q_norm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
        self.token_shift_on = token_shift_on
        self.value_residual_mode = value_residual_mode if config.value_residual else "none"
        if token_shift_on:
            self.q_shift = nn.Parameter(torch.zeros(qk))
            self.k_shift = nn.Parameter(torch.zeros(kk))
        if token_shift_on or self.value_residual_mode in ("rwkv", "rwkv_post_tokenshift"):
            # also the token-shift mix of the value-gate input in 'rwkv_post_tokenshift'
            self.v_shift = nn.Parameter(torch.zeros(vv))
        if self.value_residual_mode == "linear":
            self.value_residual_lambda = nn.Parameter(torch.tensor(0.5))
        elif self.value_residual_mode != "none":
            rank = value_residual_rank(config.hidden_size)
            self.value_gate_bias = nn.Parameter(torch.zeros(1, 1, vv))
            self.value_gate_down = zero_initialised(nn.Linear(config.hidden_size, rank, bias=False))
            self.value_gate_up = FullPrecisionLinear(rank, vv, bias=False)

    def project(self, x: torch.Tensor, v_first: torch.Tensor | None, step: Step,
                cache_layer) -> tuple[torch.Tensor, ...]:
        """q, k [N, H, Dqk] (normed, not rotated) and v [N, H, Dv] of the flat tokens x [1, N, hidden]; the
        token shifts follow each row's tokens (the step's `token_shift`)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if q.shape[-1] != self.num_heads * self.head_dim:  # a tensor-parallel rank's share of the heads
            check_tensor_parallel_size(self.config, self.num_heads * self.head_dim // q.shape[-1])
        if self.value_residual_mode in ("rwkv", "rwkv_post_tokenshift"):
            # the gate reads the input, or its token shift with all of v_shift (also where tensor parallelism
            # shards v_shift by head); its own carry, so computing it first changes no other stream
            gate_input = x if self.value_residual_mode == "rwkv" else \
                step.token_shift(x, full_tensor(self.v_shift), cache_layer, "x", "first")
            value_gate = torch.sigmoid(local_tensor(self.value_gate_bias)
                                       + self.value_gate_up(self.value_gate_down(gate_input))).to(v.dtype)
        if self.value_residual_mode == "linear":
            v = (1 - self.value_residual_lambda) * v + self.value_residual_lambda * v_first.view_as(v)
        elif self.value_residual_mode == "rwkv":
            v = v + (v_first.to(v.dtype) - v) * value_gate
        if self.token_shift_on:
            q, k, v = step.token_shifts([(q, local_tensor(self.q_shift), "q"), (k, local_tensor(self.k_shift), "k"),
                                         (v, local_tensor(self.v_shift), "v")], cache_layer, "first")
        if self.value_residual_mode == "rwkv_post_tokenshift":
            v = v + (v_first.to(v.dtype) - v) * value_gate
        # -1 heads: under tensor parallelism a rank holds only its share of them
        q = self.q_norm(q[0].unflatten(-1, (-1, self.head_dim)))
        k = self.k_norm(k[0].unflatten(-1, (-1, self.head_dim)))
        return q, k, v[0].unflatten(-1, (-1, self.value_head_dim))

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs [N, H, Dv], as [1, N, hidden]."""
        return self.o_proj(y.flatten(1)[None])


    @property
    def eager(self) -> bool:
        """attn_implementation="eager": attention as explicit products instead of torch's fused kernel."""
        return self.config._attn_implementation == "eager"


class KVMSlidingWindowAttention(KVMAttentionBase):
    """Plain causal attention over the last `sliding_window` tokens (research 'swa' mixer)."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.sliding_window_token_shift, config.sliding_window_value_residual_mode)
        self.window = config.sliding_window_size

    def forward(self, x, v_first, rotary, step: Step, cache_layer) -> torch.Tensor:
        q, k, v = self.project(x, v_first, step, cache_layer)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        return self.output(step.attend(self, cache_layer, q, k, v, None))

    def step_plan(self, tokens: RowTokens) -> Pieces:
        """The forward's sliding-window pieces, made once and shared by the layers of this window."""
        return tokens.once(("sliding pieces", self.window), lambda: sliding_pieces(self.window, tokens))

    def attend_decoding(self, q, k, v, gate: None, step: DecodeStep, cache_layer) -> torch.Tensor:
        """A decoding step's token per row over its ring, itself written into it first, in one graph
        (decode_step_kvm)."""
        page, keys, values = cache_layer.update(k, v, None, step)
        no_state = keys[:, :, :0], values[:, :, :0]
        return decoding_attention(q, *no_state, keys, values)(
            q, page, *no_state, step.state_slots * 0, keys, values, step.sliding_visible[:, :keys.shape[2]],
            None, None, q.shape[-1] ** -0.5)

    def attend_tokens(self, q, k, v, gate: None, tokens: RowTokens, cache_layer) -> torch.Tensor:
        """Each token's queries over the keys of its last `sliding_window` positions (no merge gates: `gate` is
        None), the newest written into the ring."""
        groups = self.step_plan(tokens).by_width(tokens)
        y = q.new_empty(q.shape[0], q.shape[1], v.shape[-1]) if len(groups) > 1 else None
        for _, group in groups:
            key_sets = window_key_sets(k, v, tokens, group, cache_layer, WINDOW, None)
            y = gathered(y, attend_pieces(q[group.query_index], key_sets, self.groups, self.eager,
                                             self.merged_key_sets), group)
        if cache_layer is not None:
            write_ring(cache_layer, tokens, WINDOW[:2], [k, v])
        return y


class KVMStateKeyNorm(nn.LayerNorm):
    """LayerNorm of state keys, which may be kept in float32 under a float16 model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class KVMAttention(KVMAttentionBase):
    """Joint softmax over the block sliding window and the key-value-means state."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.kvm_token_shift, config.kvm_value_residual_mode)
        self.state_key_norm = KVMStateKeyNorm(self.head_dim, eps=config.layer_norm_eps)
        self.gated = config.merge_gate_keys or config.merge_gate_values
        if self.gated:
            self.merge_gate_proj = FullPrecisionLinear(config.hidden_size, self.kv_heads, bias=False)  # one per state
        if config.head_temperatures:
            self.window_temperature = nn.Parameter(torch.ones(self.num_heads))
            self.state_temperature = nn.Parameter(torch.ones(self.num_heads))

    def temperature(self, name: str) -> torch.Tensor | None:
        """Per-head temperature `name` [H] (None when off)."""
        return local_tensor(getattr(self, name)) if hasattr(self, name) else None

    def forward(self, x, v_first, rotary, step: Step, cache_layer) -> torch.Tensor:
        q, k, v = self.project(x, v_first, step, cache_layer)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        gate = (1.0 + F.elu(self.merge_gate_proj(x[0]))).unsqueeze(-1) if self.gated else None  # [N, Hkv, 1]
        return self.output(step.attend(self, cache_layer, q, k, v, gate))

    def attend_decoding(self, q, k, v, gate, step: DecodeStep, cache_layer) -> torch.Tensor:
        """A decoding step's token per row over its row's state and window, written into them first (the ring
        slot; a first-chunk state slot), in one graph (decode_step_kvm)."""
        entering = self.first_chunk_entries(k, v, gate, slice(None)) if step.first_chunk is not None else None
        page, state_keys, state_values, window_keys, window_values = cache_layer.update(k, v, gate, step, entering)
        state_temperature = window_temperature = None
        if self.config.head_temperatures:
            state_temperature = local_tensor(self.state_temperature)
            window_temperature = local_tensor(self.window_temperature)
        return decoding_attention(q, state_keys, state_values, window_keys, window_values)(
            q, page, state_keys, state_values, step.state_slots, window_keys, window_values,
            step.window_visible[:, :window_keys.shape[2]], state_temperature, window_temperature,
            q.shape[-1] ** -0.5)

    def attend_tokens(self, q, k, v, gate, tokens: RowTokens, cache_layer) -> torch.Tensor:
        """`attend` on the forward's plan (its pieces and state schedule, made once and shared by the layers)."""
        pieces, schedule = self.step_plan(tokens)
        return self.attend(q, k, v, gate, tokens, pieces, schedule, cache_layer)

    def step_plan(self, tokens: RowTokens) -> tuple[Pieces, StateSchedule]:
        """The forward's chunk pieces and state schedule, made once and shared by the KVM layers."""
        def plan():
            pieces = chunk_pieces(self.config, tokens)
            return pieces, state_schedule(self.config, tokens, pieces)
        return tokens.once("chunk pieces", plan)

    def attend(self, q, k, v, gate, tokens: RowTokens, pieces: Pieces, schedule: StateSchedule,
               cache_layer) -> torch.Tensor:
        """Every piece's queries over its row's state (as of its chunk) and its block window, in one batched
        softmax; the rows' states brought up to date on the way (first-chunk slots, folds) and stored with the
        window's newest tokens."""
        names = WINDOW if self.gated else WINDOW[:2]
        reads = self.state_reads(k, v, gate, tokens, pieces, schedule, cache_layer)
        groups = pieces.by_width(tokens)
        y = q.new_empty(q.shape[0], q.shape[1], v.shape[-1]) if len(groups) > 1 else None
        for index, group in groups:
            key_sets = window_key_sets(k, v, tokens, group, cache_layer, names, self.temperature("window_temperature"))
            if reads is not None:
                keys, values, slots = (t if index is None else t[index] for t in (*reads, schedule.piece_slots))
                visible = torch.arange(keys.shape[2], device=q.device) < slots[:, None]
                key_sets.insert(0, KeySet(keys, values, visible[:, None, :], self.temperature("state_temperature")))
            y = gathered(y, attend_pieces(q[group.query_index], key_sets, self.groups, self.eager,
                                             self.merged_key_sets), group)
        if cache_layer is not None:
            write_ring(cache_layer, tokens, names, [k, v] + ([gate] if self.gated else []))
            cache_layer.fold_ahead(tokens.starts, tokens.counts, self.state_key_norm, k.dtype)
        return y

    # -- the state (state_kvm has the math) --
    def state_reads(self, k, v, gate, tokens: RowTokens, pieces: Pieces, schedule: StateSchedule,
                    cache_layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state each piece reads, as attention reads it ([P, Hkv, slots, d] keys and values, padded), or None
        when no piece reads state; the rows' states are brought up to date on the way. On a cache, first-chunk
        tokens enter their slots in place, one slot each, and a row's whole state is rewritten only when a block
        folds into it (once a chunk); without one, the states are built here from empty."""
        state_dtype = state_dtype_for(k.dtype)
        versions: dict[int, list[int]] = {}  # version -> pieces reading it
        for index, (version, slots) in enumerate(zip(schedule.piece_version, schedule.piece_slot_list)):
            if slots:
                versions.setdefault(version, []).append(index)
        reads = []  # (piece indices, [r, Hkv, slots, d] keys and values of those pieces' rows)
        in_place = cache_layer is not None and not torch.is_grad_enabled()  # else the states keep their gradients
        if in_place:
            if schedule.first_chunk_rows.numel():
                self.enter_first_chunk(k, v, gate, tokens, schedule, cache_layer)
            working = self.stored_state(cache_layer, schedule) if schedule.folds else None
            if versions.get(0):
                readers = versions[0]
                rows = None if pieces.identity_rows and len(readers) == pieces.count else pieces.row[readers]
                # only the slots some piece reads: a page holds the most a request can reach
                reads.append((readers, [cache_layer.read(name, rows, schedule.read_slots) for name in READ]))
        else:
            working = self.working_state(k, v, gate, schedule, cache_layer, state_dtype)
            if versions.get(0):
                local = torch.tensor([schedule.local[pieces.rows[p]] for p in versions[0]], device=k.device)
                reads.append((versions[0], self.readable(tuple(t[local] for t in working), k.dtype)))
        folded_rows: set[int] = set(range(len(schedule.rows))) if cache_layer is not None and not in_place else set()
        for round_index, fold in enumerate(schedule.folds, start=1):
            ahead = None if cache_layer is None else cache_layer.take_fold_ahead(fold.blocks, fold.member_list,
                                                                                 schedule.capacity)
            if ahead is None:
                block = self.block_tokens(k, v, gate, fold, cache_layer)
                folded = run_fold(block_fold(self.config, self.state_key_norm, tuple(t[fold.rows] for t in working),
                                             fold.slots, block, fold.appends, state_dtype))
                read = None
            else:
                folded, read = ahead
            working = tuple(t.index_copy(0, fold.rows, new) for t, new in zip(working, folded))
            folded_rows.update(fold.row_list)
            readers = versions.get(round_index, [])
            if readers:
                position = {local: i for i, local in enumerate(fold.row_list)}
                picks = torch.tensor([position[schedule.local[pieces.rows[p]]] for p in readers], device=k.device)
                read = self.readable(folded, k.dtype) if read is None else read
                reads.append((readers, tuple(t[picks] for t in read)))
            self.record_folds(cache_layer, [schedule.rows[i] for i in fold.row_list], fold, working, k.dtype)
        if cache_layer is not None and folded_rows:
            self.store_state(cache_layer, tokens.batch, schedule, sorted(folded_rows), working, k.dtype)
        if not reads:
            return None
        if len(reads) == 1 and len(reads[0][0]) == pieces.count:
            return tuple(fit_slots(t, schedule.read_slots) for t in reads[0][1])
        return tuple(self.assemble(reads, pieces.count, schedule.read_slots, part) for part in (0, 1))

    @staticmethod
    def assemble(reads: list, count: int, slots: int, part: int) -> torch.Tensor:
        """[P, Hkv, slots, d]: each piece's read state from the sources in `reads`."""
        first = reads[0][1][part]
        out = first.new_zeros(count, first.shape[1], slots, first.shape[3])
        for indices, tensors in reads:
            out.index_copy_(0, torch.tensor(indices, device=out.device), fit_slots(tensors[part], slots))
        return out

    def first_chunk_slots(self, k, v, gate, index: torch.Tensor, state_dtype: torch.dtype) -> tuple:
        """The state slots (key, value, norm) first-chunk tokens `index` enter the state as, one each; the norms of
        the ungated values, the merge gate applied where the config says."""
        keys = state_keys(k[index].to(state_dtype), self.config.rotary_dim, self.state_key_norm)
        values = v[index].to(state_dtype)
        norms = slot_norms(values, self.config.state_value_norms)
        if self.config.merge_gate_initial_state and gate is not None:
            gates = gate[index].to(state_dtype)
            keys, values = keys * gates, values * gates
        return keys, values, norms

    def first_chunk_entries(self, k, v, gate, index) -> tuple:
        """Tokens `index` as first-chunk state slots, one each, and those slots' read form (STATE + READ order):
        what rows still in their first chunk enter their state with."""
        state = self.first_chunk_slots(k, v, gate, index, state_dtype_for(k.dtype))
        return state + self.readable(state, k.dtype)

    def enter_first_chunk(self, k, v, gate, tokens: RowTokens, schedule: StateSchedule, cache_layer) -> None:
        """First-chunk tokens into their rows' stored states, one slot each, with the slots' read form (both are
        per slot, so the rest of the state is untouched); kept in the layer's record while recording."""
        rows, slots = schedule.first_chunk_rows, schedule.first_chunk_slots
        entries = self.first_chunk_entries(k, v, gate, schedule.first_chunk_tokens)
        like = {name: (t.shape[1], t.shape[2], t.dtype, t.device) for name, t in zip(STATE + READ, entries)}
        cache_layer.ensure_state(tokens.batch, schedule.first_chunk_capacity, like)
        for name, tensor in zip(STATE + READ, entries):
            cache_layer.write(name, rows, tensor.detach(), slots)
        if cache_layer.record is not None:
            cache_layer.record.first_chunk = (rows, slots, tuple(t.detach() for t in entries))

    def stored_state(self, cache_layer, schedule: StateSchedule) -> tuple:
        """[r, Hkv, capacity, d] stored states of the rows whose state changes in this forward."""
        rows = torch.tensor(schedule.rows, dtype=torch.long, device=schedule.fresh.device)
        return tuple(fit_slots(cache_layer.read(name, rows), schedule.capacity) for name in STATE)

    def working_state(self, k, v, gate, schedule: StateSchedule, cache_layer, state_dtype: torch.dtype) -> tuple:
        """[r, Hkv, capacity, d] states of the rows whose state changes in this forward, as tensors autograd
        follows: the stored ones (empty for rows starting fresh, or without a cache) with this forward's first-chunk
        tokens entered, one slot each."""
        heads, capacity = k.shape[1], schedule.capacity
        shapes = ((k.shape[2], state_dtype), (v.shape[2], state_dtype), (1, torch.float32))
        if cache_layer is not None and not schedule.all_fresh:
            working = [torch.where(schedule.fresh[:, None, None, None], 0, t)
                       for t in self.stored_state(cache_layer, schedule)]
        else:
            working = [k.new_zeros(len(schedule.rows), heads, capacity, dim, dtype=dtype) for dim, dtype in shapes]
        if schedule.initial_rows.numel():
            entered = self.first_chunk_slots(k, v, gate, schedule.initial_index, state_dtype)
            slot = schedule.initial_slot[:, None, :, None].expand(-1, heads, -1, 1)
            working = [t.index_copy(0, schedule.initial_rows,
                                    scatter_into(t[schedule.initial_rows], slot, new.transpose(1, 2)))
                       for t, new in zip(working, entered)]
        return tuple(working)

    def block_tokens(self, k, v, gate, fold, cache_layer) -> list[torch.Tensor]:
        """The keys, values (and merge gates) [r, Hkv, chunk, d] of the blocks a round of folds takes, from the
        cached window or this forward's tokens."""
        block = []
        for name, new in zip(WINDOW if self.gated else WINDOW[:2], (k, v, gate)):
            tokens = new[fold.new_index].transpose(1, 2)
            if fold.reads_ring:
                ring = cache_layer.read(name, fold.members)
                cached = ring.gather(2, fold.ring_slot[:, None, :, None].expand(-1, ring.shape[1], -1, ring.shape[3]))
                tokens = torch.where(fold.source_ring[:, None, :, None], cached.to(tokens.dtype), tokens)
            block.append(tokens)
        return block

    def readable(self, state: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`state_kvm.readable_state` of a (padded) state."""
        return readable_state(state, self.state_key_norm(state[0]), self.config.state_value_norms, dtype)

    def store_state(self, cache_layer, batch: int, schedule: StateSchedule, local: list[int], working: tuple,
                    dtype: torch.dtype) -> None:
        """The folded rows' states (`local`: indices into the schedule's rows) and their read forms into the layer's
        storage (room made in dense storage)."""
        index = torch.tensor(local, dtype=torch.long, device=working[0].device)
        rows = torch.tensor([schedule.rows[i] for i in local], dtype=torch.long, device=working[0].device)
        state = tuple(t[index] for t in working)
        cache_layer.store(rows, batch, schedule.capacity, state + self.readable(state, dtype))

    def record_folds(self, cache_layer, rows: list[int], fold, working, dtype) -> None:
        """While recording: the state rows hold after a round of folds (from the token that started the fold on)."""
        if cache_layer is None or cache_layer.record is None:
            return
        state = tuple(t[fold.rows] for t in working)
        window = self.config.window_chunks
        valid_from = [(block + window) * self.config.chunk_size + 1 for block in fold.blocks]
        cache_layer.record.states.append((rows, valid_from, state + self.readable(state, dtype)))


def scatter_into(state: torch.Tensor, slot: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`state` [r, H, S, d] with tokens [r, H, n, d] written into slots [r, H, n, 1] (slot S: nowhere)."""
    padded = F.pad(state, (0, 0, 0, 1))
    return padded.scatter(2, slot.expand(-1, -1, -1, tokens.shape[-1]), tokens)[:, :, :-1]


# ---- feed-forward and blocks ---------------------------------------------------------------
class KVMMLP(nn.Module):
    """relu^2 feed-forward with optional token shift (zeros before the first token)."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = zero_initialised(nn.Linear(config.ffn_size, config.hidden_size, bias=False))
        self.token_shift_on = config.ffn_token_shift
        if self.token_shift_on:
            self.shift = nn.Parameter(torch.zeros(1, 1, config.hidden_size))

    def forward(self, x: torch.Tensor, step: Step, cache_layer) -> torch.Tensor:
        if self.token_shift_on:
            x = step.token_shift(x, self.shift, cache_layer, "ffn", "zero")
        return self.down_proj(F.relu(self.up_proj(x)).square())


class KVMDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: attention (KVM or sliding-window) then feed-forward, scaled residuals."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__()
        self.sliding = config.is_sliding_window_layer(layer_idx)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = (KVMSlidingWindowAttention if self.sliding else KVMAttention)(config, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = KVMMLP(config, layer_idx)
        self.residual_scale = config.residual_scale
        self.anchors = value_anchor_layers(config).get(layer_idx, ())
        if config.block_lambdas:
            self.block_lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(
        self, hidden_states, x0, v_first, rotary, step: Step, cache_layer=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [1, N, hidden] of the forward's flat tokens. `cache_layer`: this layer's storage in a
        KVMCache, or None (no cache: checkpoint recomputation replays identically). Returns the new hidden
        states and, for a layer in `value_anchor_layers`, its value-residual anchor (else None), which it then
        uses itself."""
        anchor = None
        if self.anchors:  # inside the layer's own forward: FSDP gathers its weights only for that
            anchor = v_first = self.self_attn.v_proj(self.input_layernorm(x0))
        if hasattr(self, "block_lambdas"):
            hidden_states = self.block_lambdas[0] * hidden_states + self.block_lambdas[1] * x0
        attn = self.self_attn(self.input_layernorm(hidden_states), v_first, rotary, step, cache_layer)
        hidden_states = hidden_states + attn * self.residual_scale
        mlp = self.mlp(self.post_attention_layernorm(hidden_states), step, cache_layer)
        return hidden_states + mlp * self.residual_scale, anchor


def value_anchor_layers(config: KVMConfig) -> dict[int, tuple[str, ...]]:
    """The layers whose plain value of x0 anchors the value residual, with the kinds of layer ("kvm",
    "sliding") that read it: the first layer of each kind, or layer 0 for both when they share it."""
    if not config.value_residual:
        return {}
    if not config.sliding_window_every:
        return {0: ("kvm",)}
    if config.sliding_window_share_value_residual:
        return {0: ("sliding", "kvm")}
    return {0: ("sliding",), 1: ("kvm",)}


# ---- models --------------------------------------------------------------------------------
class KVMPreTrainedModel(CachedDecodingSaveMixin, SdpaOrEagerMixin, HeadLossMixin, QuantizedLoadMixin,
                         PreTrainedModel):
    attention_model_name = "KVM"
    attention_refusal = KVM_NO_KERNELS
    config_class = KVMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KVMDecoderLayer"]
    _supports_sdpa = True
    # never quantized, float32 under a float16 load: the merge gate (one output per state) and the value gate's
    # up-projection (rank 32 input); the head is kept by transformers' own default (the output embeddings)
    _keep_in_fp32_modules = full_precision_modules("merge_gate_proj", "value_gate_up")

    def runtime_speedups(self) -> contextlib.AbstractContextManager:
        """A block in which inference takes the speed-ups the seams found (oneDNN linears, blocked weight copies)
        and outside which the model is plain; same results up to float rounding. generate() opens one; a loop that
        steps the model itself can too."""
        return speedups_block(self, None)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh-model init after the research code's scheme (small embeddings, zeroed outputs)."""
        config = self.config
        if isinstance(module, nn.Embedding):
            init.uniform_(module.weight, a=-1e-4, b=1e-4)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            if getattr(module, "init_kind", None) == "zeros":
                init.zeros_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=module.in_features**-0.5)
        elif isinstance(module, KVMMLP):
            if module.token_shift_on:
                depth = 1.0 - module.layer_idx / config.num_hidden_layers
                ramp = torch.arange(config.hidden_size, dtype=torch.float32) / config.hidden_size
                init.copy_(module.shift, (1.0 - ramp.pow(depth**4)).view(1, 1, -1).to(module.shift.dtype))
        elif isinstance(module, KVMDecoderLayer) and hasattr(module, "block_lambdas"):
            init.copy_(module.block_lambdas, torch.tensor([1.0, 0.0]))
        if isinstance(module, KVMAttentionBase):
            depth = 1.0 - module.layer_idx / config.num_hidden_layers
            for name, power in (("q_shift", 0.2), ("k_shift", 0.7), ("v_shift", 0.7)):
                param = getattr(module, name, None)
                if param is not None:
                    ramp = torch.arange(param.numel(), dtype=torch.float32) / param.numel()
                    value = 1.0 - ramp.pow(power * depth) if module.token_shift_on else torch.zeros_like(ramp)
                    init.copy_(param, value.to(param.dtype))
            if hasattr(module, "value_gate_bias"):
                n = module.value_gate_bias.numel()
                linear = torch.arange(n, dtype=torch.float32) / (n - 1) - 0.5
                init.copy_(module.value_gate_bias, (0.73 - 0.4 * linear).view(1, 1, n).to(module.value_gate_bias.dtype))
            if hasattr(module, "value_residual_lambda"):
                init.constant_(module.value_residual_lambda, 0.5)
        if isinstance(module, KVMAttention) and config.head_temperatures:
            init.ones_(module.window_temperature)
            init.ones_(module.state_temperature)


def state_training_length(config: KVMConfig) -> int:
    """Shortest sequence that trains every KVM weight: block 1 is merged into the state when the first token of
    chunk `window_chunks + 1` arrives, and that token's prediction has a label only if one more token follows."""
    return config.chunk_size * (config.window_chunks + 1) + 2


class KVMModel(KVMPreTrainedModel):
    """Embeddings, KVM / sliding-window decoder layers and the final norm."""

    def __init__(self, config: KVMConfig):
        config.validate_kvm()  # from_pretrained(..., field=value) sets fields after the config's own check
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(KVMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    # A forward reading one token per row on a cache runs as a `DecodeStep` (decode_step_kvm: one graph, the
    # geometry and folds prepared before it); False sends it through the general path, its reference.
    decode_steps = True

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KVMCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: KVMCache | None = None,
        step: Step | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Padding (attention_mask == 0, anywhere) is skipped per row: each row's chunk boundaries and state
        follow its own real tokens. Without a mask every token is real and the model is strictly causal
        (right padding needs no mask). Rotary positions are `position_ids` when given, else each row's count of
        real tokens before. A packed batch (position_ids restarting at 0, or `cu_seq_lens_q`/`seq_idx`) runs
        each document as if alone in its row (`packed_forward`). A caller that prepares its own `step` passes it
        (a serving engine its flat tokens, their positions as `position_ids`, and a cache over its pages)."""
        cache = take_cache(past_key_values, cache)
        output_hidden_states = config_default(output_hidden_states, self.config, "output_hidden_states")
        if step is None:
            step, cache = self.step_of(cache, input_ids, inputs_embeds, attention_mask, position_ids,
                                       config_default(use_cache, self.config, "use_cache"), kwargs)
        if step is None:
            refuse_packed_cache(use_cache, cache, "KVM")  # as asked: the config's default does not refuse
            return self.packed_forward(input_ids, inputs_embeds, attention_mask, position_ids, kwargs,
                                       output_attentions, output_hidden_states)
        refuse_attention_weights(output_attentions, self.config, KVM_NO_WEIGHTS)
        x0 = step.flatten(self.embed_norm(self.embed_tokens(input_ids) if inputs_embeds is None
                                          else inputs_embeds))[None]
        rotary = self.rotary(step.rotary_positions(position_ids))
        anchors = {"kvm": None, "sliding": None}  # value-residual anchors, made by `value_anchor_layers`
        hidden_states, all_hidden = x0, []
        for idx, layer in enumerate(self.layers):
            if output_hidden_states:  # returned in the batch's layout, and the layer reads them from there
                all_hidden.append(step.unflatten(hidden_states[0]))
                hidden_states = step.flatten(all_hidden[-1])[None]
            kind = "sliding" if layer.sliding else "kvm"
            hidden_states, anchor = layer(hidden_states, x0, anchors[kind], rotary[kind], step,
                                          cache.layers[idx] if cache is not None else None)
            anchors.update(dict.fromkeys(layer.anchors, anchor))
        hidden_states = self.norm(hidden_states)[0]
        if output_hidden_states:
            all_hidden.append(step.unflatten(hidden_states))
        step.finish(cache)
        return BaseModelOutputWithPast(
            last_hidden_state=all_hidden[-1] if output_hidden_states else step.unflatten(hidden_states),
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            **{CACHE_NAME: cache if config_default(use_cache, self.config, "use_cache") else None},
        )

    def rotary(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """The rotary tables of each kind of layer at the tokens' `positions` [N]."""
        config, head = self.config, self.config.qk_head_dim
        tables = {"kvm": rotary_tables(positions, config.rotary_dim, head, config.rope_theta), "sliding": None}
        if config.sliding_window_every:
            tables["sliding"] = rotary_tables(positions, config.sliding_window_rotary_dim, head,
                                              config.sliding_window_rope_theta)
        return tables

    def step_of(self, cache: KVMCache | None, input_ids, inputs_embeds, attention_mask, position_ids,
                use_cache: bool, kwargs: dict) -> tuple[Step | None, KVMCache | None]:
        """The forward's step and cache: the step prepared for it (generate() prepares it in
        `prepare_inputs_for_generation`), else one prepared now; no step for packed documents (`packed_forward`).
        Without a cache, a forward under `use_cache` gets a new one; under gradient checkpointing none (the
        recomputation would update it again)."""
        if cache is not None:
            check_cache(cache, KVMCache, self.config)
            if cache.prepared_step is None:
                self.prepare_step(cache, input_ids, attention_mask, position_ids, inputs_embeds, **kwargs)
            step = cache.take_prepared_step()
            if step is not None:
                return step, cache
        source = input_ids if input_ids is not None else inputs_embeds
        if isinstance(source, torch.Tensor) and source.ndim >= 2 and packed_documents(
                position_ids, attention_mask, kwargs, *source.shape[:2], "KVM") is not None:
            return None, cache
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            cache = None
        elif cache is None and use_cache:
            cache = KVMCache(self.config)
        step = self.prompt_step(cache, source, input_ids, inputs_embeds, attention_mask, position_ids)
        seen = (cache.columns if cache is not None else 0) + step.columns
        if self.training and torch.is_grad_enabled() and seen < state_training_length(self.config):
            logger.warning_once(
                f"Training KVM on {seen}-token sequences: blocks enter the state only once a chunk has left "
                f"the attention window, so the merge gate and state norm get no gradient below "
                f"{state_training_length(self.config)} tokens ((window_chunks + 1) * chunk_size + 2).")
        return step, cache

    def prepare_step(self, cache: KVMCache, input_ids, attention_mask=None, position_ids=None, inputs_embeds=None,
                     **kwargs) -> Step | None:
        """The step of the next forward on `cache` without autograd - a `DecodeStep` when every row reads one real
        token, else a `PromptStep` - with its host work done (checks, the rows' geometry and plans, folds a decoding
        token reads, bookkeeping), parked on the cache (`cache.prepared_step`) for that forward to take. None for a
        forward the general path runs (autograd, recording, a serving engine's pages, packed documents; `kwargs`:
        the forward's document boundaries). generate() runs it from `prepare_inputs_for_generation`, so that a
        compiled forward has no host work left."""
        source = input_ids if input_ids is not None else inputs_embeds
        if (cache.paged or cache.recording or torch.is_grad_enabled() or not isinstance(source, torch.Tensor)
                or source.ndim < 2):
            return None
        cache.prepared_step = (
            self.prepare_decode_step(cache, source, input_ids, inputs_embeds, attention_mask, position_ids)
            or self.prepare_prompt_step(cache, source, input_ids, inputs_embeds, attention_mask, position_ids,
                                        kwargs))
        return cache.prepared_step

    def prepare_decode_step(self, cache: KVMCache, source: torch.Tensor, input_ids, inputs_embeds, attention_mask,
                            position_ids) -> DecodeStep | None:
        """The `DecodeStep` of a forward that reads one real token in every row of `cache`, with the folds its
        tokens read done and the rows advanced; None for any other forward."""
        if (not self.decode_steps or not cache.rows or not all(cache.seen)
                or tuple(source.shape[:2]) != (cache.rows, 1)):
            return None
        check_input_ids(input_ids, inputs_embeds, self.config.vocab_size, cache)
        valid = real_tokens(attention_mask, cache.rows, 1, cache.columns, source.device)
        if valid is not None and not bool(valid.all()):
            return None
        seen = list(cache.seen)
        if position_ids is not None:
            own = torch.tensor(seen, device=source.device)[:, None]
            check_position_ids(position_ids, own, None, cache.rows, "KVM", "state and token shifts")
        step = self.decoding_step(cache, seen, source.device)
        cache.count_decoding_step()
        return step

    def prepare_prompt_step(self, cache: KVMCache, source: torch.Tensor, input_ids, inputs_embeds, attention_mask,
                            position_ids, kwargs: dict) -> PromptStep | None:
        """The `PromptStep` of any other cached forward (prompts, chunks of them, rows at different positions);
        None for packed documents."""
        if packed_documents(position_ids, attention_mask, kwargs, *source.shape[:2], "KVM") is not None:
            return None
        return self.prompt_step(cache, source, input_ids, inputs_embeds, attention_mask, position_ids)

    def prompt_step(self, cache: KVMCache | None, source: torch.Tensor, input_ids, inputs_embeds, attention_mask,
                    position_ids) -> PromptStep:
        """A forward's rows and rotary positions from the mask and the cache (if any), the cache made ready and
        each layer's plan (pieces, state schedule) made."""
        check_input_ids(input_ids, inputs_embeds, self.config.vocab_size, cache)
        batch, length = source.shape[:2]
        valid = real_tokens(attention_mask, batch, length, cache.columns if cache is not None else 0, source.device)
        if valid is not None and bool(valid.all()):
            valid = None  # all tokens real: the unpadded path
        starts = cache.row_starts(batch) if cache is not None else [0] * batch
        tokens = RowTokens.from_batch(starts, valid, batch, length, source.device)
        positions = None
        if position_ids is not None:
            own = query_positions(tokens.start, valid, length)
            check_position_ids(position_ids, own, valid, batch, "KVM", "state and token shifts")
            positions = tokens.flatten(position_ids.to(source.device).expand(batch, length)[..., None])[:, 0]
        if cache is not None:
            cache.prepare(tokens)
        for layer in self.layers:
            layer.self_attn.step_plan(tokens)
        return PromptStep(tokens, positions, length)

    def decoding_step(self, cache: KVMCache, seen: list[int], device) -> DecodeStep:
        """The `DecodeStep` of rows at `seen` (> 0) reading one token each, with the folds their tokens read done
        and dense storage made room in: the host work of a decoding step, before its forward."""
        folding = rows_folding(self.config, seen)
        for layer, cache_layer in zip(self.layers, cache.layers):
            if not layer.sliding:
                cache_layer.fold_due(seen, folding, layer.self_attn.state_key_norm)
                cache_layer.make_room_for_first_chunk(seen)
        return decode_step(self.config, seen, device)

    def packed_forward(self, input_ids, inputs_embeds, attention_mask, position_ids, kwargs: dict,
                       output_attentions, output_hidden_states) -> BaseModelOutputWithPast:
        """A packed batch: its documents in chunk-aligned length buckets, each bucket run as an unpacked
        right-padded batch (window, chunk grid, state, token shift, value residual and rotary positions all
        start at each document's first token), the outputs scattered back to the packed layout."""
        source = input_ids if input_ids is not None else inputs_embeds
        batch, length = source.shape[:2]
        documents = packed_documents(position_ids, attention_mask, kwargs, batch, length, "KVM")
        align = self.config.chunk_size
        outputs, indices, counts = [], [], []
        for bucket in length_buckets(documents, align):
            width, index = bucket_index(bucket, align, source.device)
            part = gather_bucket(source, len(bucket), width, index)
            inputs = {"input_ids": part} if input_ids is not None else {"inputs_embeds": part}
            outputs.append(self(**inputs, use_cache=False, output_attentions=output_attentions,
                                output_hidden_states=output_hidden_states, return_dict=True))
            indices.append(index)
            counts.append(sum(doc.length for doc in bucket))
        return BaseModelOutputWithPast(**scatter_outputs(outputs, indices, counts, batch, length))


def check_input_ids(input_ids, inputs_embeds, vocab_size: int, cache: KVMCache | None) -> None:
    """Clear errors for inputs the model cannot read: exactly one of input_ids and inputs_embeds, of the
    right shape (token ids checked as `check_token_ids` does)."""
    if input_ids is not None and inputs_embeds is not None:
        raise ValueError("Pass either input_ids or inputs_embeds, not both.")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("Pass input_ids or inputs_embeds.")
    if inputs_embeds is None:
        check_token_ids(input_ids, vocab_size, cache)
    elif inputs_embeds.ndim != 3 or inputs_embeds.shape[0] == 0 or inputs_embeds.shape[1] == 0:
        raise ValueError(f"inputs_embeds must be a non-empty [batch, length, hidden] tensor, "
                         f"got shape {tuple(inputs_embeds.shape)}")


class KVMForCausalLM(KVMPreTrainedModel, OwnCacheGenerationMixin, GenerationMixin):
    """KVM model with a language-modelling head (optional logit soft-cap)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # when config.tie_word_embeddings
    _tp_plan = {"lm_head": "colwise_gather_output"}

    @property
    def cache_class(self) -> type:
        """The cache generate() makes (read when used: the generated file defines it further down)."""
        return KVMCache

    def __init__(self, config: KVMConfig):
        super().__init__(config)
        self.model = KVMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, *args, **kwargs) -> dict:
        """transformers' inputs for the next forward, and its step prepared on the cache (`KVMModel.prepare_step`:
        a decoding step's folds included), so that the forward - compiled or not - has no host work left."""
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        cache = inputs.get(GENERATE_CACHE_KWARG)
        if isinstance(cache, KVMCache) and cache.prepared_step is None:
            self.model.prepare_step(cache, inputs.get("input_ids"), inputs.get("attention_mask"),
                                    inputs.get("position_ids"), inputs.get("inputs_embeds"), **boundary_kwargs(inputs))
        return inputs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head, then tanh soft-capping when the config sets a cap."""
        logits = self.lm_head(hidden)
        cap = self.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KVMCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: KVMCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """transformers' causal-LM forward; `return_dict=False` (argument or config) returns the tuple."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            cache=cache,
            return_dict=True,
            **boundary_kwargs(kwargs),
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits, loss = self.logits_and_loss(outputs.last_hidden_state[:, keep, :], labels, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


__all__ = ["KVMPreTrainedModel", "KVMModel", "KVMForCausalLM"]
