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

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple, logging

from .cache_kvm import KVMCache, KVMLayerCache, SlidingWindowLayerCache, new_layer_cache
from .carried_card import CarriedCardMixin
from .configuration_kvm import KVMConfig, state_dtype_for
from .conventions import (SdpaOrEagerMixin, attention, check_position_ids, config_default,
                          refuse_attention_weights)
from .generation_cache import CachedDecodingSaveMixin, OwnCacheGenerationMixin
from .model_inputs import CACHE_NAME, check_cache, check_token_ids, take_cache
from .onednn_linear import OneDNNLinear, sharing_parameters
from .row_block_loss import RowBlockLossMixin
from .runtime_kvm import one_query_attention, prepare_next_fold, take_fold_ahead
from .runtime_switch import runtime_speedups
from .state_kvm import Fold, Overflow, append_count, query_slice, readable_state, run_fold, slot_norms, state_keys
from .step_plan import (GroupedStepPlan, RowGroup, boundary_kwargs, bucket_index, chunk_pieces, gather_bucket,
                        length_buckets, packed_documents, real_tokens, refuse_packed_cache, scatter_outputs)
from .tensor_parallel import full_tensor, local_tensor

logger = logging.get_logger(__name__)


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
    """Rotate adjacent channel pairs of x [B, H, T, D]; tables are [T, D] or [B, T, D]."""
    if tables is None:
        return x
    cos, sin = (t.to(x.dtype) for t in tables)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return cos * x + sin * swapped


def lower_right_causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Query i (the last q_len of kv_len positions) sees keys up to its own position."""
    q_idx = torch.arange(q_len, device=device).unsqueeze(1)
    kv_idx = torch.arange(kv_len, device=device).unsqueeze(0)
    return kv_idx <= q_idx + (kv_len - q_len)


def value_residual_rank(hidden_size: int) -> int:
    return max(32, int(round(1.3 * hidden_size**0.5 / 32) * 32))


def token_shift(plan: GroupedStepPlan, x: torch.Tensor, mix: torch.Tensor, carries, name: str,
                first: str) -> torch.Tensor:
    """Token shift x + mix * (x[t-1] - x[t]) over each row's real tokens, updating the carry of `name`.
    A row's first token has no predecessor: itself ("first") or zero ("zero")."""
    carry = carries.get(name) if carries is not None else None
    if plan.previous_index is None:
        if carry is None or not plan.has_prior:
            previous = x[:, :1] if first == "first" else torch.zeros_like(x[:, :1])
        else:
            previous = carry.to(x.dtype)
        if carries is not None:
            carries.set(name, x[:, -1:])
            carries.record(name, x)
        return x + mix * (torch.cat([previous, x[:, :-1]], dim=1) - x)
    if carry is None:
        carry = x.new_zeros(x.shape[0], 1, x.shape[-1])
    source = torch.cat([carry.to(x.dtype), x], dim=1)
    index = plan.first_previous_index if first == "first" else plan.previous_index
    previous = source.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
    if carries is not None:
        carries.set(name, source.gather(1, plan.last_index[..., None].expand(-1, -1, x.shape[-1])))
        carries.record(name, x)
    return x + mix * (previous - x)


def run_segments(plan: GroupedStepPlan, caches: list, attend, q, k, v, *extra) -> torch.Tensor:
    """Run `attend(cache, q, k, v, *extra)` per row group on its real tokens; padding columns get zeros."""
    if len(plan.segments) == 1 and plan.segments[0].whole_batch:
        return attend(caches[0], q, k, v, *extra)
    out = None
    for segment, cache in zip(plan.segments, caches):
        y = attend(cache, *(segment.take(t) for t in (q, k, v, *extra)))
        if out is None:  # in the dtype attention returns (autocast's), not the inputs'
            out = y.new_zeros(q.shape[:3] + y.shape[-1:])
        segment.put(out, y)
    if out is None:  # no row has a real token in this step
        out = v.new_zeros(q.shape[:3] + v.shape[-1:])
    return out


@torch.compiler.disable
def run_cached_segments(plan: GroupedStepPlan, caches: list, attend, q, k, v, *extra) -> torch.Tensor:
    """`run_segments` on a cache, never compiled (see `KVMAttention.cached_step`)."""
    return run_segments(plan, caches, attend, q, k, v, *extra)


# ---- attention -----------------------------------------------------------------------------
def zero_initialised(linear: nn.Linear) -> nn.Linear:
    """Tag an output projection that starts at zero. `_init_weights` reads the tag on the layer itself:
    transformers skips remote-code containers that own no parameters directly, never a layer that does."""
    linear.init_kind = "zeros"
    return linear


class KVMAttentionBase(nn.Module):
    """q/k/v projections with per-head layer norm, optional token shift and value residual."""

    def __init__(self, config: KVMConfig, layer_idx: int, token_shift_on: bool, value_residual_mode: str):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.kv_heads
        self.head_dim = config.qk_head_dim
        self.value_head_dim = config.v_head_dim
        qk, kk, vv = (self.num_heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.value_head_dim)
        self.q_proj = OneDNNLinear(config.hidden_size, qk, bias=False)
        self.k_proj = OneDNNLinear(config.hidden_size, kk, bias=False)
        self.v_proj = OneDNNLinear(config.hidden_size, vv, bias=False)
        self.o_proj = zero_initialised(OneDNNLinear(self.num_heads * self.value_head_dim, config.hidden_size,
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
            self.value_gate_down = zero_initialised(OneDNNLinear(config.hidden_size, rank, bias=False))
            self.value_gate_up = OneDNNLinear(rank, vv, bias=False)

    def value_gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(local_tensor(self.value_gate_bias) + self.value_gate_up(self.value_gate_down(x)))

    def project(self, x: torch.Tensor, v_first: torch.Tensor | None, plan: GroupedStepPlan, carries) -> tuple[torch.Tensor, ...]:
        """Return q, k [B, H, T, Dqk] (normed, not rotated) and v [B, H, T, Dv]; shifts follow each row's real tokens."""
        batch, length, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if q.shape[-1] != self.num_heads * self.head_dim:  # a tensor-parallel rank's share of the heads
            self.config.check_tensor_parallel(self.num_heads * self.head_dim // q.shape[-1])
        if self.value_residual_mode == "linear":
            v = (1 - self.value_residual_lambda) * v + self.value_residual_lambda * v_first.view_as(v)
        elif self.value_residual_mode == "rwkv":
            v = v + (v_first.to(v.dtype) - v) * self.value_gate(x).to(v.dtype)
        if self.token_shift_on:
            q = token_shift(plan, q, local_tensor(self.q_shift), carries, "q", "first")
            k = token_shift(plan, k, local_tensor(self.k_shift), carries, "k", "first")
            v = token_shift(plan, v, local_tensor(self.v_shift), carries, "v", "first")
        if self.value_residual_mode == "rwkv_post_tokenshift":
            # the mix of the (whole) input: all of v_shift, also where tensor parallelism shards it by head
            shifted = token_shift(plan, x, full_tensor(self.v_shift), carries, "x", "first")
            v = v + (v_first.to(v.dtype) - v) * self.value_gate(shifted).to(v.dtype)
        # -1 heads: under tensor parallelism a rank holds only its share of them
        q = self.q_norm(q.view(batch, length, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, length, -1, self.head_dim)).transpose(1, 2)
        v = v.view(batch, length, -1, self.value_head_dim).transpose(1, 2)
        return q, k, v

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return self.o_proj(y.transpose(1, 2).flatten(2))

    @property
    def eager(self) -> bool:
        """attn_implementation="eager": window attention as explicit products instead of torch's fused kernel."""
        return self.config._attn_implementation == "eager"


class KVMSlidingWindowAttention(KVMAttentionBase):
    """Plain causal attention over the last `sliding_window` tokens (research 'swa' mixer)."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.sliding_window_token_shift, config.sliding_window_value_residual_mode)
        self.window = config.sliding_window_size

    def forward(self, x, v_first, rotary, plan: GroupedStepPlan, state) -> torch.Tensor:
        carries, caches = state if state is not None else (None, [SlidingWindowLayerCache() for _ in plan.segments])
        q, k, v = self.project(x, v_first, plan, carries)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        step = run_segments if state is None else run_cached_segments
        return self.output(step(plan, caches, self.attend, q, k, v))

    def attend(self, cache: SlidingWindowLayerCache, q, k, v) -> torch.Tensor:
        """Causal attention of new tokens over the group's last `window` tokens and themselves."""
        if cache.journal is not None:
            cache.journal["inputs"] = (k, v)
        start, length = cache.seen, q.shape[2]
        if start == 0:
            cache.window.start_at(0)
        cache.window.append((k, v))
        first_key = max(0, start - self.window + 1)
        keys, values = cache.window.view(first_key, start + length)
        q_pos = torch.arange(start, start + length, device=q.device).unsqueeze(1)
        k_pos = torch.arange(first_key, start + length, device=q.device).unsqueeze(0)
        mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        y = attention(q, keys, values, mask, self.eager)
        cache.window.drop_before(start + length - self.window)
        cache.seen = start + length
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
            self.merge_gate_proj = OneDNNLinear(config.hidden_size, self.kv_heads, bias=False)  # one per state
        if config.head_temperatures:
            self.window_temperature = nn.Parameter(torch.ones(self.num_heads))
            self.state_temperature = nn.Parameter(torch.ones(self.num_heads))

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Key/value-head tensor [B, Hkv, ...] repeated for the query heads of each group [B, H, ...]."""
        group = self.config.kv_group_size
        return x if group == 1 else x.repeat_interleave(group, dim=1)

    def temperature(self, name: str) -> torch.Tensor | float:
        """Per-head temperature `name` shaped to scale [B, H, T, D] keys or queries (1 when off)."""
        if not self.config.head_temperatures:
            return 1.0
        return local_tensor(getattr(self, name)).view(1, -1, 1, 1)

    def forward(self, x, v_first, rotary, plan: GroupedStepPlan, state) -> torch.Tensor:
        carries, caches = state if state is not None else (None, [KVMLayerCache() for _ in plan.segments])
        q, k, v = self.project(x, v_first, plan, carries)
        q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
        gate = None
        if self.gated:
            gate = (1.0 + F.elu(self.merge_gate_proj(x))).transpose(1, 2).unsqueeze(-1)  # [B, Hkv, T, 1]
        if state is None:
            return self.output(run_segments(plan, caches, self.run_chunks, q, k, v, gate))
        return self.output(self.cached_step(plan, caches, q, k, v, gate))

    @torch.compiler.disable
    def cached_step(self, plan: GroupedStepPlan, caches: list, q, k, v, gate) -> torch.Tensor:
        """`run_chunks` on a cache, then, without autograd, each cache's next fold computed ahead whatever steps
        the model (runtime_kvm.prepare_next_fold; unless `paced_folds` is off); a forward that builds a graph
        folds at the boundary, as training does. Never compiled: traced, the cache's positions and buffer offsets become symbolic sizes,
        and inductor's kernels for them returned NaN logits in decoding steps (greedy tokens other than eager's)."""
        y = run_segments(plan, caches, self.run_chunks, q, k, v, gate)
        if self.paced_folds and not torch.is_grad_enabled():
            for cache in caches:
                prepare_next_fold(self, cache, whole=q.shape[2] > 1)
        return y

    # Without autograd a cached step computes the next fold ahead (`prepare_next_fold`); False folds at the chunk
    # boundary instead (the same tensors), for a caller that rebuilds its cache every step (the vLLM plugin).
    paced_folds = True
    # Under autograd a fresh forward past the front window attends all its chunks in one call
    # (`attend_chunks_at_once`); False keeps the chunk loop, the reference it equals.
    chunks_at_once = True
    # Inside `runtime_speedups`: a one-query CPU float32 step takes runtime_kvm's matrix-vector products
    # (`attend_state_and_window`); False keeps the plain products, the reference they equal.
    one_query_kernel = False

    def run_chunks(self, cache: KVMLayerCache, q, k, v, gate) -> torch.Tensor:
        """Process one group's new tokens (any count, any cache state) chunk by chunk; returns [G, H, T, Dv].

        Each chunk's state is final before its attention, and the attention changes no state: a training
        forward computes every chunk's state first, then the attention of all chunks at once."""
        if cache.journal is not None:
            cache.journal["inputs"] = (k, v, gate)
        chunk, window_chunks = self.config.chunk_size, self.config.window_chunks
        at_once = (self.chunks_at_once and torch.is_grad_enabled() and cache.seen == 0
                   and q.shape[2] > window_chunks * chunk)
        pieces = chunk_pieces(cache.seen, q.shape[2], chunk, window_chunks)
        # split, not sliced: a slice's gradient is a zero-filled copy of the whole sequence, per chunk
        queries = q.split([stop - pos for pos, stop in pieces], dim=2)
        outputs, reads = [], []
        for (pos, stop), q_piece, (window_k, window_v, state) in zip(pieces, queries,
                                                                     self.update_chunks(cache, pieces, k, v, gate)):
            window_k, window_v = self.query_heads(window_k), self.query_heads(window_v)
            if at_once:
                reads += [state] if state is not None else [None] * math.ceil((stop - pos) / chunk)
            elif state is None:
                outputs.append(self.attend_window(q_piece, window_k, window_v))
            else:
                outputs.append(self.attend_state_and_window(q_piece, window_k, window_v, *state))
        if at_once:
            return self.attend_chunks_at_once(q, self.query_heads(k), self.query_heads(v), reads)
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    def attend_chunks_at_once(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reads: list) -> torch.Tensor:
        """The chunk loop's attention over a fresh forward's tokens as one attention call: every chunk's
        queries over its state (`reads[c]`: keys [G, H, slots, D] and value columns [G, H, Dv, slots] as
        `read_state` gives them, None for the front chunks, which read no state) and its causal block window.

        Chunks become a batch dimension: states are padded to the largest one and windows gathered as
        `window_chunks` shifted copies of the blocks (zero blocks before the first), masked. q, k, v:
        [G, H, T, D] (query heads); returns [G, H, T, Dv].
        """
        chunk, window_chunks = self.config.chunk_size, self.config.window_chunks
        groups, heads, length, _ = q.shape
        count = len(reads)  # chunks, the last one possibly partial

        def blocks(x: torch.Tensor) -> torch.Tensor:  # [G, chunks, H, chunk, D], the layout attention takes
            x = F.pad(x, (0, 0, 0, count * chunk - length))
            return x.view(groups, heads, count, chunk, x.shape[-1]).transpose(1, 2)

        def windows(x: torch.Tensor) -> torch.Tensor:  # [G, chunks, H, window_chunks * chunk, D]
            x = F.pad(blocks(x), (0, 0, 0, 0, 0, 0, window_chunks - 1, 0))
            return torch.cat([x[:, offset : offset + count] for offset in range(window_chunks)], dim=3)

        # the window temperature scales keys here (the loop scales queries): the same logits
        window_k, window_v = windows(k * self.temperature("window_temperature")), windows(v)
        sizes = [0 if read is None else read[0].shape[2] for read in reads]
        slots = max(sizes)

        def stacked(index: int, dim: int) -> torch.Tensor:  # [G, chunks, H, slots, dim]: every chunk's state, padded
            parts = []
            for read in reads:
                if read is None:
                    parts.append(q.new_zeros(groups, heads, slots, dim))
                    continue
                part = read[index] if index == 0 else read[index].transpose(-1, -2)
                parts.append(F.pad(part, (0, 0, 0, slots - part.shape[2])))
            return torch.stack(parts, dim=1)

        keys = torch.cat([stacked(0, k.shape[-1]), window_k], dim=3).flatten(0, 1)
        values = torch.cat([stacked(1, v.shape[-1]), window_v], dim=3).flatten(0, 1)
        # state slot s is seen by chunk c when the chunk has that many slots; window key m by query i when it is
        # at or before the query and not before position 0
        state_seen = torch.arange(slots, device=q.device) < torch.tensor(sizes, device=q.device).unsqueeze(1)
        query = torch.arange(chunk, device=q.device).view(1, chunk, 1)
        key = torch.arange(window_chunks * chunk, device=q.device).view(1, 1, -1)
        first_block = (window_chunks - 1 - torch.arange(count, device=q.device)).clamp(min=0).view(count, 1, 1)
        window_seen = (key <= query + (window_chunks - 1) * chunk) & (key >= first_block * chunk)
        mask = torch.cat([state_seen.unsqueeze(1).expand(count, chunk, slots), window_seen], dim=2)
        mask = mask.unsqueeze(1).repeat(groups, 1, 1, 1)  # [G * chunks, 1, chunk, keys]
        y = attention(blocks(q).flatten(0, 1), keys, values, mask, self.eager)  # [G * chunks, H, chunk, Dv]
        y = y.view(groups, count, heads, chunk, -1).transpose(1, 2).flatten(2, 3)
        return y[:, :, :length]

    def update_chunks(self, cache: KVMLayerCache, pieces: list[tuple[int, int]], k, v, gate):
        """For each piece in turn, bring the cache up to it (blocks that left the window folded into the
        state, first-chunk tokens added, the piece's tokens in the window) and yield its window keys, window
        values and the state it reads (None in the front window). A generator: the chunk loop attends each
        piece before the next one's state is made, so only one state is alive at a time."""
        chunk, window_chunks = self.config.chunk_size, self.config.window_chunks
        state_dtype = state_dtype_for(k.dtype)
        sizes = [stop - pos for pos, stop in pieces]
        gates = gate.split(sizes, dim=2) if gate is not None else [None] * len(pieces)
        if cache.seen == 0:
            cache.window.start_at(0)
        for (pos, stop), k_piece, v_piece, gate_piece in zip(pieces, k.split(sizes, dim=2), v.split(sizes, dim=2), gates):
            chunk_idx = pos // chunk
            window_begin = 0 if chunk_idx < window_chunks else (chunk_idx + 1 - window_chunks) * chunk
            for block in range(cache.merged_blocks + 1, chunk_idx - window_chunks + 1):
                self.fold_block(cache, block, state_dtype)
                cache.merged_blocks = block
                cache.note_state_change(pos, "fold")
            cache.window.append((k_piece, v_piece, gate_piece))
            if pos < chunk:
                first = min(stop, chunk) - pos
                before_len = cache.state_len
                self.add_initial_tokens(cache, k_piece[:, :, :first], v_piece[:, :, :first],
                                        None if gate_piece is None else gate_piece[:, :, :first], state_dtype)
                cache.note_state_change(pos, "initial", before_len, pos + first)
            window_k, window_v = cache.window.view(window_begin, stop)[:2]
            state = self.read_state(cache, k.dtype) if chunk_idx >= window_chunks else None
            cache.window.drop_before(window_begin)
            cache.seen = stop
            yield window_k, window_v, state

    def attend_window(self, q, keys, values) -> torch.Tensor:
        """Causal attention inside the front window (no state yet); temperature on the queries."""
        q = q * self.temperature("window_temperature")
        if q.shape[2] == keys.shape[2] and not self.eager:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        mask = lower_right_causal_mask(q.shape[2], keys.shape[2], q.device) if q.shape[2] > 1 else None
        return attention(q, keys, values, mask, self.eager)

    def attend_state_and_window(self, q, keys, values, state_keys, state_value_columns) -> torch.Tensor:
        """One softmax over state slots and window keys, without concatenating keys/values.

        The per-head window temperature scales the queries of the window logits rather than
        the window keys: the same logits without rewriting the window every step.
        """
        scale = 1.0 / math.sqrt(q.shape[-1])
        window_q = q * self.temperature("window_temperature")
        if self.one_query_kernel and q.shape[2] == 1 and q.device.type == "cpu" and q.dtype == torch.float32:
            # the same softmax as the products below, as matrix-vector products (runtime_kvm)
            return one_query_attention(q, window_q, keys, values, state_keys, state_value_columns, scale)
        state_logits = torch.matmul(q, state_keys.transpose(-1, -2)).float()
        window_logits = torch.matmul(window_q, keys.transpose(-1, -2)).float()
        if q.shape[2] > 1:
            mask = lower_right_causal_mask(q.shape[2], keys.shape[2], q.device)
            window_logits = window_logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(torch.cat([state_logits, window_logits], dim=-1) * scale, dim=-1).to(values.dtype)
        slots = state_keys.shape[2]
        state_part = torch.matmul(probs[..., :slots], state_value_columns.transpose(-1, -2))
        return state_part + torch.matmul(probs[..., slots:], values)

    # -- the state (state_kvm has the math) --
    def add_initial_tokens(self, cache: KVMLayerCache, k, v, gate, state_dtype: torch.dtype) -> None:
        """Tokens of the first chunk enter the state directly, one slot each (norms of the ungated values)."""
        keys = state_keys(k.to(state_dtype), self.config.rotary_dim, self.state_key_norm)
        values, norms = v.to(state_dtype), slot_norms(v, self.config.state_value_norms)
        if self.config.merge_gate_initial_state and gate is not None:
            keys, values = keys * gate.to(state_dtype), values * gate.to(state_dtype)
        if cache.state_keys is not None:
            keys, values, norms = (torch.cat(pair, dim=2) for pair in zip(cache.state(), (keys, values, norms)))
        cache.set_state(keys, values, norms)

    def fold_block(self, cache: KVMLayerCache, block: int, state_dtype: torch.dtype) -> None:
        """Fold window block `block` (>= 1), which is leaving the window, into the state, every stage at once;
        a fold computed ahead from this state is swapped in (the same tensors bit for bit)."""
        if not take_fold_ahead(cache, block):
            cache.set_state(*run_fold(self.block_fold(cache, block, state_dtype)))

    def block_fold(self, cache: KVMLayerCache, block: int, state_dtype: torch.dtype) -> Fold:
        """The fold of window block `block` into the cache's state, before its stages (state_kvm): the block
        as the state takes it, the budget's appends, the routing dtype, and the state keys normed to read
        this state when the cache has them (else normed at the first stage)."""
        return Fold(cache.state(), cache.normed_state_keys(), self.overflow(cache, block, state_dtype),
                    append_count(self.config, block, cache.state_len), self.config.sink_slots, self.state_key_norm,
                    self.config.state_value_norms, self.merge_score_dtype(cache))

    def merge_score_dtype(self, cache: KVMLayerCache) -> torch.dtype:
        """dtype the merge routing is scored in (config.merge_routing_dtype): float32 or the finer state dtype,
        or the model's own dtype (its window keys'), as the research mixer scores it under bfloat16."""
        model_dtype = cache.window.storage[0].dtype
        if self.config.merge_routing_dtype == "model":
            return model_dtype
        return torch.promote_types(state_dtype_for(model_dtype), torch.float32)

    def overflow(self, cache: KVMLayerCache, block: int, state_dtype: torch.dtype) -> Overflow:
        """Window block `block` as the state takes it, the merge gate applied where the config says."""
        config, chunk = self.config, self.config.chunk_size
        k, v, *gate = cache.window.view(block * chunk, (block + 1) * chunk)
        keys, values = state_keys(k.to(state_dtype), config.rotary_dim, self.state_key_norm), v.to(state_dtype)
        gate = gate[0].to(state_dtype) if self.gated else None
        merge_keys = keys * gate if config.merge_gate_keys else keys
        merge_values = values * gate if config.merge_gate_values else values
        if config.merge_gate_appends:
            return Overflow(keys, merge_keys, merge_values, merge_keys, merge_values)
        return Overflow(keys, keys, values, merge_keys, merge_values)

    def read_state(self, cache: KVMLayerCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """State keys and value columns as attention reads them; recomputed only when the state changed."""
        if cache.read_cache is None:
            normed = self.state_key_norm(cache.state_keys)
            cache.normed_keys = (cache.state_keys, normed)  # the next fold compares against the same keys
            cache.read_cache = self.readable(cache.state(), normed, dtype)
        return cache.read_cache

    def readable(self, state: tuple, normed: torch.Tensor, dtype: torch.dtype,
                 heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """`state_kvm.readable_state` of a state of key/value heads `heads`, repeated for their query heads,
        with those query heads' temperatures."""
        temperature = self.temperature("state_temperature")
        if isinstance(temperature, torch.Tensor):
            temperature = temperature[:, query_slice(heads, self.config.kv_group_size)]
        state = tuple(self.query_heads(t) for t in state)
        return readable_state(state, self.query_heads(normed), temperature, self.config.state_value_norms, dtype)


# ---- feed-forward and blocks ---------------------------------------------------------------
class KVMMLP(nn.Module):
    """relu^2 feed-forward with optional token shift (zeros before the first token)."""

    def __init__(self, config: KVMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = OneDNNLinear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = zero_initialised(OneDNNLinear(config.ffn_size, config.hidden_size, bias=False))
        self.token_shift_on = config.ffn_token_shift
        if self.token_shift_on:
            self.shift = nn.Parameter(torch.zeros(1, 1, config.hidden_size))

    def forward(self, x: torch.Tensor, plan: GroupedStepPlan, carries) -> torch.Tensor:
        if self.token_shift_on:
            x = token_shift(plan, x, self.shift, carries, "ffn", "zero")
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
        self, hidden_states, x0, v_first, rotary, plan: GroupedStepPlan, state=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`state`: (carries, per-segment layer caches) from a KVMCache, or None for a fresh per-call
        state (so that checkpoint recomputation replays identically). Returns the new hidden states and, for a
        layer in `value_anchor_layers`, its value-residual anchor (else None), which it then uses itself."""
        anchor = None
        if self.anchors:  # inside the layer's own forward: FSDP gathers its weights only for that
            anchor = v_first = self.self_attn.v_proj(self.input_layernorm(x0))
        if hasattr(self, "block_lambdas"):
            hidden_states = self.block_lambdas[0] * hidden_states + self.block_lambdas[1] * x0
        attn = self.self_attn(self.input_layernorm(hidden_states), v_first, rotary, plan, state)
        hidden_states = hidden_states + attn * self.residual_scale
        carries = state[0] if state is not None else None
        mlp = self.mlp(self.post_attention_layernorm(hidden_states), plan, carries)
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
class KVMPreTrainedModel(CarriedCardMixin, CachedDecodingSaveMixin, SdpaOrEagerMixin, RowBlockLossMixin,
                        PreTrainedModel):
    attention_model_name = "KVM"
    attention_refusal = KVM_NO_KERNELS
    config_class = KVMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KVMDecoderLayer"]
    _supports_sdpa = True

    def runtime_speedups(self) -> contextlib.AbstractContextManager:
        """A block in which inference takes runtime_kvm's speed-ups (oneDNN linears, one-query CPU attention,
        folds computed ahead) and outside which the model is plain; same results up to float rounding.
        generate() opens one; a loop that steps the model itself can too."""
        return runtime_speedups(self, KVMAttention)

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
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Padding (attention_mask == 0, anywhere) is skipped per row: each row's chunk boundaries and state
        follow its own real tokens. Without a mask every token is real and the model is strictly causal
        (right padding needs no mask). Rotary positions are `position_ids` when given, else each row's count of
        real tokens before. A packed batch (position_ids restarting at 0, or `cu_seq_lens_q`/`seq_idx`) runs
        each document as if alone in its row (`packed_forward`)."""
        cache = take_cache(past_key_values, cache)
        source = input_ids if input_ids is not None else inputs_embeds
        documents = packed_documents(position_ids, attention_mask, kwargs, *source.shape[:2], "KVM") \
            if isinstance(source, torch.Tensor) and source.ndim >= 2 else None
        if documents is not None:
            refuse_packed_cache(use_cache, cache, "KVM")
            return self.packed_forward(documents, input_ids, inputs_embeds, output_attentions, output_hidden_states)
        if cache is not None:
            check_cache(cache, KVMCache, self.config)
        check_input_ids(input_ids, inputs_embeds, self.config.vocab_size, cache)
        refuse_attention_weights(output_attentions, self.config, KVM_NO_WEIGHTS)
        output_hidden_states = config_default(output_hidden_states, self.config, "output_hidden_states")
        use_cache = config_default(use_cache, self.config, "use_cache")
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache, cache = False, None  # the cache would be updated again by the recomputation
        if use_cache and cache is None:
            cache = KVMCache(self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        x0 = self.embed_norm(inputs_embeds)
        batch, length = x0.shape[:2]
        seen = (cache.columns if cache is not None else 0) + length
        if self.training and torch.is_grad_enabled() and seen < state_training_length(self.config):
            logger.warning_once(
                f"Training KVM on {seen}-token sequences: blocks enter the state only once a chunk has left the "
                f"attention window, so the merge gate and state norm get no gradient below "
                f"{state_training_length(self.config)} tokens ((window_chunks + 1) * chunk_size + 2).")
        valid = real_tokens(attention_mask, batch, length, cache.columns if cache is not None else 0, x0.device)
        if valid is not None and bool(valid.all()):
            valid = None  # all tokens real: the unpadded path
        if cache is not None:
            plan = cache.plan(batch, length, valid, x0.device)
        else:
            fresh = [new_layer_cache(self.config, i) for i in range(self.config.num_hidden_layers)]
            plan = GroupedStepPlan(batch, length, valid, [RowGroup(list(range(batch)), fresh)], x0.device)
        positions = plan.positions
        if position_ids is not None:
            check_position_ids(position_ids, positions, valid, batch, "KVM", "state and token shifts")
            positions = position_ids.to(x0.device)
        head = self.config.qk_head_dim
        kvm_rotary = rotary_tables(positions, self.config.rotary_dim, head, self.config.rope_theta)
        sliding_rotary = None
        if self.config.sliding_window_every:
            sliding_rotary = rotary_tables(
                positions, self.config.sliding_window_rotary_dim, head, self.config.sliding_window_rope_theta
            )
        anchors = {"kvm": None, "sliding": None}  # value-residual anchors, made by `value_anchor_layers`
        hidden_states, all_hidden = x0, []
        for idx, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden_states)
            state = (cache.carries[idx], cache.layer_caches(idx, plan)) if cache is not None else None
            kind, rotary = ("sliding", sliding_rotary) if layer.sliding else ("kvm", kvm_rotary)
            hidden_states, anchor = layer(hidden_states, x0, anchors[kind], rotary, plan, state)
            anchors.update(dict.fromkeys(layer.anchors, anchor))
        if cache is not None:
            cache.finish(plan)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            **{CACHE_NAME: cache if use_cache else None},
        )

    def packed_forward(self, documents, input_ids, inputs_embeds, output_attentions, output_hidden_states):
        """A packed batch: its documents in chunk-aligned length buckets, each bucket run as an unpacked
        right-padded batch (window, chunk grid, state, token shift, value residual and rotary positions all
        start at each document's first token), the outputs scattered back to the packed layout."""
        source = input_ids if input_ids is not None else inputs_embeds
        batch, length = source.shape[:2]
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
    cache_class = KVMCache

    def __init__(self, config: KVMConfig):
        super().__init__(config)
        self.model = KVMModel(config)
        self.lm_head = OneDNNLinear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _get_resized_lm_head(self, *args, **kwargs) -> nn.Module:
        """transformers' resized head (an nn.Linear) as a OneDNNLinear: the model's layers choose their product."""
        return sharing_parameters(super()._get_resized_lm_head(*args, **kwargs))

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
