"""Maglev (Sliding Recurrent Memory) on an exact nanochat GPT backbone.

The decoder P is a nanochat GPT with sliding-window attention whose keys and values carry the
previous token's memory `m_{t-1} = rms_norm(h_{t-1})`. Training runs the prefiller Q in
parallel and feeds P the shifted prefiller memories; inference feeds P its own memories.
"""

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple

from ..common.conventions import (
    FullPrecisionLinear,
    HeadLossMixin,
    QuantizedLoadMixin,
    SdpaOrEagerMixin,
    attention,
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
    StepPlan,
    boundary_kwargs,
    bucket_index,
    bucket_mask,
    gather_bucket,
    gather_columns,
    length_buckets,
    packed_documents,
    previous_real_index,
    query_positions,
    real_tokens,
    refuse_packed_cache,
    scatter_outputs,
)
from ..common.tensor_parallel import local_columns, local_tensor
from ..common.transformers_versions import CACHE_NAME, GENERATE_CACHE_KWARG
from .cache_maglev import ChunkStep, MaglevCache, MaglevCacheLayer, PrefillStep, TokenStep, visible_keys
from .configuration_maglev import MaglevConfig
from .curriculum_maglev import Schedule, current_schedule, lifted_passes, schedule_at

# the seam of the one-query ring attention (speedups/runtime_maglev): the module where the package's speed-ups are,
# else None and the plain masked attention runs
runtime_maglev = package_speedups("runtime_maglev")

# why the models refuse what transformers offers for plain attention
MAGLEV_NO_KERNELS = ("decoding attends over a ring of cached window keys with per-row positions under masks of "
                     "its own; flash, flex and paged kernels do not run them")
MAGLEV_NO_WEIGHTS = ("Maglev models return no attention weights: decoding attends token by token over a ring of "
                     "cached keys whose slots are not token positions")

# A forward's modes, chosen in one place (`MaglevModel.forward_mode`)
FORWARD_MODES = {
    "no_memory": "use_memory=False: P (nanochat's GPT) over the chunk in parallel",
    "given_memory": "memory_inputs given (tests, research): P in parallel fed those memories",
    "lifted": "lifted training (training mode and training_forward='lifted', or lifted=True; a kept prefiller, a "
              "fresh sequence): curriculum_maglev.lifted_passes",
    "prefill": "memory_prefill='prefiller' and a first forward of several tokens: Q reads the prompt and P runs on "
               "it in parallel (what follows the prompt in the same forward, recurrently: assisted decoding)",
    "recurrent": "everything else (decoding, continuing a cache, a first forward under memory_prefill='recurrent', "
                 "training_forward='recurrent' included): P token after token fed its own memory",
}

# Queries per attention call when a long chunk runs in parallel (prefiller prompts, training). Each call
# computes its block's queries against QUERY_BLOCK + window keys, masked, so smaller blocks waste less.
QUERY_BLOCK = 256


@dataclass
class MaglevModelOutput(BaseModelOutputWithPast):
    """Base output plus P's memories `m`, the prefiller's `m'` (lifted training) and their consistency loss."""

    memories: torch.Tensor | None = None
    prefiller_memories: torch.Tensor | None = None
    consistency_loss: torch.Tensor | None = None
    pass_hidden_states: tuple[torch.Tensor, ...] | None = None  # head inputs of every lifted pass (self-feeding)


@dataclass
class MaglevCausalLMOutput(CausalLMOutputWithPast):
    """Causal-LM output with the two parts of `loss = lm_loss + consistency_weight * consistency_loss`."""

    lm_loss: torch.Tensor | None = None
    consistency_loss: torch.Tensor | None = None


def with_init(module: nn.Module, kind: str, value: float = 0.0) -> nn.Module:
    """Tag a parameter-owning layer with its documented init ("uniform" bound, "normal" std or "zeros").

    `_init_weights` reads the tag on the layer itself: transformers skips remote-code containers that own
    no parameters directly, but never a layer that does, so the init cannot depend on which modules it visits."""
    module.init_kind, module.init_value = kind, value
    return module


def rms_norm(x: torch.Tensor, eps: float | None) -> torch.Tensor:
    """Weightless RMSNorm as nanochat (eps=None means the dtype's machine epsilon)."""
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def uniform_bound(config: MaglevConfig) -> float:
    """nanochat's uniform init bound for input projections: sqrt(3 / hidden) (std 1/sqrt(hidden))."""
    return math.sqrt(3.0 / config.hidden_size)


def inverse_frequencies(config: MaglevConfig, device: torch.device) -> torch.Tensor:
    channels = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (config.rope_theta ** (channels / config.head_dim))


def rotary_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """The rotation at positions [B, T] as two [B, T, 1, head_dim] tables for
    `apply_rotary`: (cos, cos) and (sin, -sin) over the two channel halves, in float32 like nanochat, then cast.

    Computed on the fly, so positions have no upper limit."""
    freqs = positions.to(torch.float32)[:, :, None, None] * inv_freq
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, -sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """nanochat's rotation of the two channel halves x1, x2 (x: [..., H, D]): (x1 cos + x2 sin, x2 cos - x1 sin),
    as whole-width products with the halves swapped (the same roundings, fewer operations per layer)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def block_mask(plan: StepPlan, left: int, block: tuple[int, int, int]) -> torch.Tensor:
    """Mask of one block's queries over the chunk's key columns [lo, end): each token sees itself and the real
    keys within `left` positions. Columns stay causal too: a padding query has the position of the next real
    token and must not see that token's key (it would leak the label of a left-padded row's first token)."""
    lo, begin, end = block

    def build():
        key_columns = torch.arange(lo, end, device=plan.start.device)[None, :]
        query_columns = torch.arange(begin, end, device=plan.start.device)[:, None]
        seen = visible_keys(plan.query_positions[:, begin:end], plan.key_positions[:, lo:end], left)
        return (seen & (key_columns <= query_columns)) | (key_columns == query_columns)
    return plan.mask(("block", left, begin), build)


def windowed_attention(plan: StepPlan, q, k, v, left: int, eager: bool, prefix_mask=None, prefix=None) -> torch.Tensor:
    """Attention of the chunk's queries over `prefix` keys/values (a ring; `prefix_mask(block)` masks a block's
    queries over the ring and the chunk's keys) and the chunk's own keys within `left`, block by block of queries
    (`eager`: as explicit products)."""
    outputs = []
    for block in plan.query_blocks(left, QUERY_BLOCK):
        lo, begin, end = block
        if (lo, begin, end) == (0, 0, plan.length):  # one block (a short chunk, a decode step): nothing to cut
            block_q, keys, values = q, k, v
        else:
            block_q, keys, values = q[:, :, begin:end], k[:, :, lo:end], v[:, :, lo:end]
        if prefix is None:
            mask = block_mask(plan, left, block)
        else:
            mask = prefix_mask(block)
            keys, values = torch.cat([prefix[0], keys], dim=2), torch.cat([prefix[1], values], dim=2)
        outputs.append(attention(block_q, keys, values, mask, eager))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def ring_mask(plan: StepPlan, ring: MaglevCacheLayer):
    """The mask of a chunk's block of queries over the ring's slots before the chunk and the chunk's own keys (per
    block, as `windowed_attention` asks for it), built once per forward and shared by the layers of one capacity and
    window."""
    def mask(block: tuple[int, int, int]) -> torch.Tensor:
        begin, end = block[1:]

        def build() -> torch.Tensor:
            slots = visible_keys(plan.query_positions[:, begin:end], ring.slot_positions(plan), ring.window)
            return torch.cat([slots, block_mask(plan, ring.window, block)], dim=-1)
        return plan.mask(("ring", ring.capacity, ring.window, begin), build)
    return mask


class MaglevAttention(nn.Module):
    """nanochat attention (GQA, value embeddings, rotary, QK-norm) with optional memory injection."""

    # Inside `runtime_speedups` (which sets it where the seam found runtime_maglev): a one-token step attends the ring
    # as its matrix-vector products (`attend`); False keeps the plain masked attention, the reference they equal.
    one_query_kernel = False

    def __init__(self, config: MaglevConfig, layer_idx: int, with_memory: bool):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # config values read every step, kept as plain attributes (config attribute access is slow)
        self.eps = config.rms_norm_eps
        self.qk_norm_scale = config.qk_norm_scale
        self.memory_gate_channels = config.memory_gate_channels
        self.value_gate_channels = config.value_embedding_gate_channels
        self.value_gate_scale = config.value_embedding_gate_scale
        bound = uniform_bound(config)
        self.q_proj = with_init(nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False),
                                "uniform", bound)
        self.k_proj = with_init(nn.Linear(config.hidden_size, config.kv_dim, bias=False), "uniform", bound)
        self.v_proj = with_init(nn.Linear(config.hidden_size, config.kv_dim, bias=False), "uniform", bound)
        self.o_proj = with_init(nn.Linear(config.hidden_size, config.hidden_size, bias=False), "zeros")
        self.value_gate = (
            with_init(FullPrecisionLinear(config.value_embedding_gate_channels, self.num_kv_heads, bias=False),
                      "zeros") if config.has_value_embedding(layer_idx) else None
        )
        self.with_memory = with_memory
        if with_memory:
            std = config.memory_init_std
            self.memory_k_proj = with_init(nn.Linear(config.hidden_size, config.kv_dim, bias=False), "normal", std)
            self.memory_v_proj = with_init(nn.Linear(config.hidden_size, config.kv_dim, bias=False), "normal", std)
            self.memory_gate = with_init(
                FullPrecisionLinear(config.memory_gate_channels, self.num_kv_heads, bias=False), "zeros")

    def forward(self, x, value_embedding, memory, rotary, window, cache_layer, step: Step):
        # x: [B, T, hidden] gives heads [B, T, H, D]; a decode step's [B, hidden] (one token per row) gives them
        # as [B, H, 1, D], the layout attention reads: plain matrix products and no reshapes around them
        flat = x.ndim == 2
        heads = (x.shape[0], -1, 1, self.head_dim) if flat else (*x.shape[:-1], -1, self.head_dim)
        axis = -3 if flat else -2  # where the heads are
        # -1 heads: under tensor parallelism a rank holds only its share of them (the memory follows its K/V heads)
        q, k, v = self.q_proj(x).view(heads), self.k_proj(x).view(heads), self.v_proj(x).view(heads)
        if memory is not None:
            # Maglev: the previous token's memory enters keys (before rotary/QK-norm) and values.
            gate = torch.sigmoid(self.memory_gate(x[..., : self.memory_gate_channels])).view(*k.shape[:-1], 1)
            k = k + gate * self.memory_k_proj(memory).view(k.shape)
            v = v + gate * self.memory_v_proj(memory).view(v.shape)
        if value_embedding is not None:
            gate = self.value_gate_scale * torch.sigmoid(self.value_gate(x[..., : self.value_gate_channels]))
            value_embedding = local_columns(value_embedding, self.v_proj.weight)  # the table is not sharded
            v = v + gate.view(*v.shape[:-1], 1) * value_embedding.view(v.shape)
        # rotary and QK-norm act per head: queries and keys go through them together (fewer small ops per step)
        qk = apply_rotary(torch.cat([q, k], dim=axis), *rotary)
        q, k = (rms_norm(qk, self.eps) * self.qk_norm_scale).split([q.shape[axis], k.shape[axis]], dim=axis)
        if not flat:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = step.attend(self, cache_layer, q, k, v, window)
        return self.o_proj(y.reshape(x.shape[0], -1) if flat else y.transpose(1, 2).reshape(*x.shape[:-1], -1))

    @property
    def eager(self) -> bool:
        """attn_implementation="eager": attention as explicit products instead of torch's fused kernel."""
        return self.config._attn_implementation == "eager"

    def attend_chunk(self, q, k, v, window: int, cache_layer: MaglevCacheLayer | None,
                     plan: StepPlan) -> torch.Tensor:
        """The chunk's queries over the cache layer's ring before the chunk (None: no cache) and the chunk's own keys
        within `window`, block by block of queries; then the chunk written into the ring (read first: a token takes
        the slot of a key it still sees)."""
        if cache_layer is None:
            return windowed_attention(plan, q, k, v, window, self.eager)
        ring = cache_layer.read_ring(k, plan.rows)
        y = windowed_attention(plan, q, k, v, window, self.eager, ring_mask(plan, cache_layer), ring)
        cache_layer.write_chunk(k, v, plan)
        return y

    def attend_token(self, q, k, v, cache_layer: MaglevCacheLayer, step: TokenStep) -> torch.Tensor:
        """One token per row: written into the ring first (`update`), then its query over the written ring and the
        key it displaced, under the layer's `RingStep` masks (made before the forward); with `one_query_kernel` on,
        as runtime_maglev's matrix-vector products (the plain attention it equals otherwise)."""
        ring_keys, ring_values, aside_keys, aside_values = cache_layer.update(k, v, step)
        ring_step = cache_layer.step
        if runtime_maglev is not None and self.one_query_kernel:
            return runtime_maglev.one_query_attention(q, aside_keys, aside_values, ring_keys, ring_values,
                                                      ring_step.written, ring_step.aside)
        keys, values = torch.cat([ring_keys, aside_keys], dim=2), torch.cat([ring_values, aside_values], dim=2)
        return attention(q, keys, values, ring_step.mask, self.eager)


class MaglevMLP(nn.Module):
    """nanochat MLP: relu^2 between two bias-free projections."""

    def __init__(self, config: MaglevConfig):
        super().__init__()
        self.up_proj = with_init(nn.Linear(config.hidden_size, config.intermediate_size, bias=False),
                                 "uniform", uniform_bound(config))
        self.down_proj = with_init(nn.Linear(config.intermediate_size, config.hidden_size, bias=False), "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.relu(hidden).square())
        # without autograd in place: a long prompt's [tokens, 4 x hidden] activations are not allocated twice more
        return self.down_proj(hidden.relu_().square_())


class MaglevBlock(GradientCheckpointingLayer):
    """Pre-norm nanochat block (weightless norms)."""

    def __init__(self, config: MaglevConfig, layer_idx: int, with_memory: bool):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.self_attn = MaglevAttention(config, layer_idx, with_memory)
        self.mlp = MaglevMLP(config)

    def forward(self, hidden, value_embedding, memory, rotary, window, cache_layer, step: Step):
        hidden = hidden + self.self_attn(rms_norm(hidden, self.eps), value_embedding, memory, rotary, window,
                                         cache_layer, step)
        return hidden + self.mlp(rms_norm(hidden, self.eps))


class MaglevPreTrainedModel(CachedDecodingSaveMixin, SdpaOrEagerMixin, HeadLossMixin, QuantizedLoadMixin,
                            PreTrainedModel):
    attention_model_name = "Maglev"
    attention_refusal = MAGLEV_NO_KERNELS
    config_class = MaglevConfig
    config: MaglevConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MaglevBlock"]
    _supports_sdpa = True
    # never quantized, float32 under a float16 load: the gates, 12-24 input channels to one output per head (or one);
    # the head is kept by transformers' own default (the output embeddings)
    _keep_in_fp32_modules = full_precision_modules("memory_gate", "value_gate", "smear_gate")
    _supports_flash_attn = False
    _can_compile_fullgraph = False

    def runtime_speedups(self) -> contextlib.AbstractContextManager:
        """A block in which inference runs the speed-ups the seams found (oneDNN linears, blocked weight copies for
        batched steps, the one-query ring attention) and outside which the model is plain; same results up to float
        rounding. generate() opens one; a loop that steps the model itself can too."""
        return speedups_block(self, MaglevAttention)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh weights: per layer the init its tag names (`with_init`), or PyTorch's layer defaults with
        `weight_init="torch"`; the model's own scalars and vectors as nanochat starts them."""
        if isinstance(module, MaglevModel):
            init_model_scalars(module)
        kind = getattr(module, "init_kind", None)
        if kind is None:
            return
        weight = module.weight
        if self.config.weight_init == "torch":
            if isinstance(module, nn.Embedding):
                init.normal_(weight, std=1.0)
            else:
                init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif kind == "zeros":
            init.zeros_(weight)
        elif kind == "uniform":
            init.uniform_(weight, -module.init_value, module.init_value)
        else:
            init.normal_(weight, std=module.init_value)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' resize, with its contract: every table indexed by token id - embeddings, value embeddings,
        lm_head - gets exactly `new_num_tokens` rows (rounded up to `pad_to_multiple_of` when given), the
        vocabulary that many ids. nanochat's own padding stops there (`pad_vocab_size_to` becomes 1: the rows
        are what was asked for). Ids of both vocabularies keep their rows; added ids start as transformers
        starts added tokens."""
        if new_num_tokens is None and pad_to_multiple_of is None:
            return self.get_input_embeddings()
        vocab = self.get_input_embeddings().weight.shape[0] if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            if not isinstance(pad_to_multiple_of, int):  # transformers' own wording, which callers may match
                raise ValueError(f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, "
                                 "which is not and integer. Please make sure to pass an integer")
            if pad_to_multiple_of < 1:
                raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
            vocab = -(-vocab // pad_to_multiple_of) * pad_to_multiple_of
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise ValueError(f"new_num_tokens must be a positive integer, got {new_num_tokens!r}")
        old_vocab, self.config.vocab_size, self.config.pad_vocab_size_to = self.config.vocab_size, vocab, 1
        self.vocab_size = vocab  # as transformers' resize sets it
        shape = (old_vocab, vocab, self.config.padded_vocab_size, mean_resizing)
        self.set_input_embeddings(self.resized_table(self.get_input_embeddings(), *shape))
        tables = self.base_model.value_embeddings
        for name in list(tables):
            tables[name] = self.resized_table(tables[name], *shape)
        if self.get_output_embeddings() is not None:
            self.set_output_embeddings(self.resized_table(self.get_output_embeddings(), *shape))
        self.tie_weights()
        return self.get_input_embeddings()

    def resized_table(self, table: nn.Module, old_vocab: int, vocab: int, rows: int, mean_resizing: bool) -> nn.Module:
        """A copy of `table` (an Embedding, or a Linear whose output rows are token ids) with `rows` rows: shared
        ids keep theirs; the others (added ids, padding) are drawn around the mean of the real rows, never the old
        padding rows (`mean_resizing`, transformers' rule), or take the table's own init."""
        weight = table.weight
        if isinstance(table, nn.Embedding):
            fresh = nn.Embedding(rows, weight.shape[1], device=weight.device, dtype=weight.dtype)
        else:
            fresh = nn.Linear(weight.shape[1], rows, bias=False, device=weight.device, dtype=weight.dtype)
        with_init(fresh, table.init_kind, table.init_value)
        kept = min(old_vocab, vocab)
        with torch.no_grad():
            if mean_resizing and rows > kept:
                real_rows = nn.Embedding.from_pretrained(weight[:old_vocab].detach())
                self._init_added_embeddings_weights_with_mean(real_rows, fresh, old_vocab, rows - kept)
            else:
                self._init_weights(fresh)
            fresh.weight[:kept] = weight[:kept]
        fresh.weight.requires_grad_(weight.requires_grad)
        fresh._is_hf_initialized = True  # a later post_init() must not redraw it
        return fresh


def init_model_scalars(model: "MaglevModel") -> None:
    """The parameters MaglevModel owns directly: residual lambdas 1, x0 lambdas 0.1, smear 0, backout 0.2,
    memory_init 0 (`transformers.initialization` skips those a checkpoint loaded)."""
    for name in ("residual_lambdas", "prefiller_residual_lambdas"):
        if getattr(model, name) is not None:
            init.ones_(getattr(model, name))
    for name in ("x0_lambdas", "prefiller_x0_lambdas"):
        if getattr(model, name) is not None:
            init.constant_(getattr(model, name), 0.1)
    if model.smear_lambda is not None:
        init.zeros_(model.smear_lambda)
    if model.backout_lambda is not None:
        init.constant_(model.backout_lambda, 0.2)
    if model.memory_init is not None:
        init.zeros_(model.memory_init)


class MaglevModel(MaglevPreTrainedModel):
    """Embeddings, the decoder P's blocks and (when kept) the prefiller Q; returns `m = rms_norm(h)`."""

    # set by MaglevForCausalLM.forward for one call when only the last position's logits are read (generate()'s
    # logits_to_keep=1, no labels): a prefiller prompt then runs P only where it reaches them or the cache
    last_position_only = False

    def __init__(self, config: MaglevConfig):
        config.validate_maglev()  # from_pretrained(..., field=value) sets fields after the config's checks
        super().__init__(config)
        rows, bound = config.padded_vocab_size, uniform_bound(config)
        self.embed_tokens = with_init(nn.Embedding(config.embedding_rows, config.hidden_size), "normal", 1.0)
        self.value_embeddings = nn.ModuleDict({
            str(i): with_init(nn.Embedding(rows, config.kv_dim), "uniform", bound)
            for i in range(config.num_hidden_layers) if config.has_value_embedding(i)
        })
        layers = config.num_hidden_layers
        self.layers = nn.ModuleList([MaglevBlock(config, i, config.use_memory) for i in range(layers)])
        lambdas = config.use_layer_lambdas
        self.residual_lambdas = nn.Parameter(torch.ones(layers)) if lambdas else None
        self.x0_lambdas = nn.Parameter(torch.zeros(layers)) if lambdas else None
        self.smear_gate = (with_init(FullPrecisionLinear(config.smear_gate_channels, 1, bias=False), "zeros")
                           if config.use_smear else None)
        self.smear_lambda = nn.Parameter(torch.zeros(1)) if config.use_smear else None
        self.backout_lambda = nn.Parameter(torch.zeros(1)) if config.use_backout else None
        self.memory_init = nn.Parameter(torch.zeros(config.hidden_size)) if config.use_memory else None
        # where the memory is read: a learned projection of h (m = rms_norm(W_m h)), and a second way in
        # through P's block input (zero at the start, so a fresh model is the paper's)
        self.memory_proj = (with_init(nn.Linear(config.hidden_size, config.hidden_size, bias=False), "uniform",
                                      bound) if config.memory_projection else None)
        self.memory_residual_proj = (
            with_init(nn.Linear(config.hidden_size, config.hidden_size, bias=False), "zeros")
            if config.memory_residual_injection else None)
        separate_prefiller = config.separate_prefiller
        self.prefiller_layers = (
            nn.ModuleList([MaglevBlock(config, i, with_memory=False) for i in range(layers)])
            if separate_prefiller else None
        )
        prefiller_lambdas = separate_prefiller and lambdas
        self.prefiller_residual_lambdas = nn.Parameter(torch.ones(layers)) if prefiller_lambdas else None
        self.prefiller_x0_lambdas = nn.Parameter(torch.zeros(layers)) if prefiller_lambdas else None
        self.gradient_checkpointing = False
        self._inv_freq: torch.Tensor | None = None  # rotary frequencies, computed at first use on each device
        self.schedule: Schedule | None = None  # the training loop's step schedules (curriculum_maglev)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_training_step(self, step: int) -> None:
        """Set the step schedules of training at optimizer step `step` (curriculum_maglev.schedule_at); the
        training loop calls it once per step (kvm_maglev.training.MaglevStepCallback), the forward reads them."""
        self.schedule = schedule_at(self.config, int(step))

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # ----- pieces ----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, previous_embedding: torch.Tensor | None, valid: torch.Tensor | None):
        """Normed token embeddings with nanochat's smear from each token's previous real token (the cached
        one for a chunk's first; none at a row's start). Returns (x0, pre-smear embeddings)."""
        raw = rms_norm(self.embed_tokens(input_ids).to(self.dtype), self.config.rms_norm_eps)
        if self.smear_gate is None:
            return raw, raw
        if previous_embedding is None:
            previous_embedding = raw.new_zeros(raw.shape[0], 1, raw.shape[2])  # zero: exactly no smear
        if raw.shape[1] == 1:
            predecessors = previous_embedding.to(raw.dtype)
        elif valid is None:
            predecessors = torch.cat([previous_embedding.to(raw.dtype), raw[:, :-1]], dim=1)
        else:
            predecessors = gather_columns(previous_embedding, raw, previous_real_index(valid))
        channels = self.config.smear_gate_channels
        gate = self.smear_lambda.to(raw.dtype) * torch.sigmoid(self.smear_gate(raw[..., :channels]))
        return raw + gate * predecessors, raw

    def rotary_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """Rotary tables at `positions` [B, T]."""
        device = positions.device
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = inverse_frequencies(self.config, device)
        return rotary_tables(self._inv_freq, positions, dtype)

    def value_embeddings_for(self, input_ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor | None]:
        """Per layer, the value embeddings of the tokens (None where the layer has none)."""
        tables = self.value_embeddings
        return [tables[str(i)](input_ids).to(dtype) if str(i) in tables else None
                for i in range(self.config.num_hidden_layers)]

    def run_stack(self, x0, value_embeddings, memory, cache, plan, rotary, prefiller=False, hidden_states=None):
        """One parallel pass over a chunk through P's (or Q's) blocks; returns `h` (after backout) and the
        vector the memory is read from (`h` itself unless `memory_source_layer` names an earlier block). A decode
        step runs the same loop in `forward`, on the model's own layers."""
        config = self.config
        if memory is not None and self.memory_residual_proj is not None:
            x0 = x0 + self.memory_residual_proj(memory)
        if prefiller:
            windows = config.prefiller_windows
            blocks = self.layers if self.prefiller_layers is None else self.prefiller_layers
            res_l = self.residual_lambdas if self.prefiller_layers is None else self.prefiller_residual_lambdas
            x0_l = self.x0_lambdas if self.prefiller_layers is None else self.prefiller_x0_lambdas
        else:
            windows, blocks, res_l, x0_l = config.decoder_windows, self.layers, self.residual_lambdas, self.x0_lambdas
        x, backout, source = x0, None, None
        for i, block in enumerate(blocks):
            if res_l is not None:
                x = res_l[i] * x + x0_l[i] * x0
            if hidden_states is not None:
                hidden_states.append(x)
            store = None if cache is None else cache.layers[i]
            x = block(x, value_embeddings[i], memory, rotary, windows[i], store, plan)
            if self.backout_lambda is not None and i == config.backout_layer:
                backout = x
            if i == config.memory_source_layer:
                source = x
        if backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * backout
        return x, (x if source is None else source)

    def read_out(self, h: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(head input rms_norm(h), memory m): m is the head input itself unless the memory has its own source
        layer or projection (m = rms_norm(W_m source))."""
        eps = self.config.rms_norm_eps
        head = rms_norm(h, eps)
        if self.memory_proj is not None:
            return head, rms_norm(self.memory_proj(source), eps)
        return head, (head if source is h else rms_norm(source, eps))

    def decode_chunk(self, input_ids, memory, cache, plan, hidden_states=None):
        """P over a chunk in parallel with the given memory inputs; updates the cache. Returns (head input, m)."""
        previous = None if cache is None else cache.previous_embedding
        x0, raw = self.embed(input_ids, previous, plan.valid)
        values = self.value_embeddings_for(input_ids, x0.dtype)
        rotary = self.rotary_for(plan.query_positions, x0.dtype)
        head, memories = self.read_out(*self.run_stack(x0, values, memory, cache, plan, rotary,
                                                       hidden_states=hidden_states))
        if cache is not None:
            cache.finish_forward(plan, raw, memories if memory is not None else None)
        return head, memories

    def prefiller_memories(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Q on a whole fresh sequence in parallel (no memory, Q's windows, padding skipped): m'."""
        plan = ChunkStep(input_ids.new_zeros(input_ids.shape[0]), valid, input_ids.shape[1])
        x0, _ = self.embed(input_ids, None, valid)
        values = self.value_embeddings_for(input_ids, x0.dtype)
        rotary = self.rotary_for(plan.query_positions, x0.dtype)
        _, memories = self.read_out(*self.run_stack(x0, values, None, None, plan, rotary, prefiller=True))
        return memories

    def shifted_memories(self, memories: torch.Tensor, first: torch.Tensor | None,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
        """mu_t = memory of the previous real token; a row's first gets `first` (the cached memory) or memory_init."""
        if first is None:
            first = self.memory_init.to(memories.dtype).expand(memories.shape[0], 1, -1)
        if valid is None:
            return torch.cat([first, memories[:, :-1]], dim=1)
        return gather_columns(first, memories, previous_real_index(valid))

    def recurrent(self, input_ids, cache, valid, hidden_states=None):
        """The paper's inference: token after token through P, each fed its row's previous memory.
        Returns (head inputs, memories).

        What does not depend on the memory - embeddings with smear, value embeddings, rotary tables -
        is computed for the whole chunk at once; only the blocks run per token."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            raise NotImplementedError("gradient checkpointing would replay cache writes in the recurrent pass; "
                                      "train with the prefiller (lifted training) or without checkpointing")
        length = input_ids.shape[1]
        x0, raw = self.embed(input_ids, cache.previous_embedding, valid)
        values = self.value_embeddings_for(input_ids, x0.dtype)
        if valid is not None and length > 1 and not cache.recording:
            return self.recurrent_rows(x0, raw, values, cache, valid, hidden_states)
        whole = cache.forward_step(valid, 1) if length == 1 else StepPlan(cache.positions, valid, length)
        rotary = self.rotary_for(whole.query_positions, x0.dtype)
        heads, outputs, per_step = [], [], []
        for t in range(length):
            step = (lambda tensor: tensor) if length == 1 else (lambda tensor: tensor[:, t:t + 1])
            plan = whole if length == 1 else cache.forward_step(None if valid is None else step(valid), 1)
            step_states = None if hidden_states is None else []
            step_values = [None if v is None else step(v) for v in values]
            head, memories = self.read_out(*self.run_stack(step(x0), step_values, cache.last_memory, cache, plan,
                                                           tuple(map(step, rotary)), hidden_states=step_states))
            cache.finish_forward(plan, step(raw), memories)
            heads.append(head)
            outputs.append(memories)
            per_step.append(step_states)
        if hidden_states is not None:
            hidden_states.extend(torch.cat(states, dim=1) for states in zip(*per_step))
        return torch.cat(heads, dim=1), torch.cat(outputs, dim=1)

    def recurrent_rows(self, x0, raw, values, cache, valid, hidden_states=None):
        """`recurrent` for rows that read different numbers of tokens (padding; a serving engine's requests): step t
        runs the t-th real token of every row that has one, so no step computes padding and rows that are done drop
        out. Each row reads its tokens in order, as in `recurrent`; outputs at padding are zeros."""
        batch, length = x0.shape[:2]
        tokens = RowTokens.from_batch(cache.positions.tolist(), valid, batch, length, x0.device)
        x0, raw = tokens.flatten(x0), tokens.flatten(raw)
        values = [None if v is None else tokens.flatten(v) for v in values]
        cos, sin = self.rotary_for(tokens.position[:, None], x0.dtype)
        heads, memories = torch.zeros_like(x0), torch.zeros_like(x0)
        states = None if hidden_states is None else [torch.zeros_like(x0) for _ in range(len(self.layers))]
        cache.reserve(length)
        for t in range(max(tokens.counts)):
            active = [row for row, count in enumerate(tokens.counts) if count > t]
            rows = torch.tensor(active, device=x0.device)
            flat = tokens.offset[rows] + t
            plan = cache.token_step(None if len(active) == batch else rows)
            step_states = None if states is None else []
            head, memory = self.read_out(*self.run_stack(
                x0[flat, None], [None if v is None else v[flat, None] for v in values],
                cache.last_memory[rows], cache, plan, (cos[flat], sin[flat]), hidden_states=step_states))
            cache.finish_rows(rows, raw[flat, None], memory)
            heads[flat], memories[flat] = head[:, 0], memory[:, 0]
            for layer_states, state in zip(states or [], step_states or []):
                layer_states[flat] = state[:, 0]
        cache.columns += length
        if hidden_states is not None:
            hidden_states.extend(tokens.unflatten(state) for state in states)
        return tokens.unflatten(heads), tokens.unflatten(memories)

    def prefill(self, input_ids, valid, cache, plan, hidden_states=None, last_only=False):
        """"prefiller" prompt processing: Q reads the prompt, P runs on it in parallel fed Q's shifted memories.
        Returns (head inputs, P's memories, Q's memories). With `last_only` (only the last position's output and
        the cache are read) P skips the prompt's leading columns that reach neither (`skippable_columns`): the head
        inputs and P's memories then cover the remaining columns only."""
        prefiller_memories = self.prefiller_memories(input_ids, valid)
        mu = self.shifted_memories(prefiller_memories, None, valid)
        cut = self.skippable_columns(input_ids.shape[1], valid, cache) if last_only else 0
        if cut:
            # P starts cold at the cut, at each row's true position (rotary and ring slots as if it had read the
            # skipped tokens); what the cold start gets wrong stays inside the columns no later layer reads
            start = plan.start + (cut if valid is None else valid[:, :cut].sum(dim=1))
            if cache is not None:
                cache.positions = start
            plan, counted = ChunkStep(start, None, input_ids.shape[1] - cut), plan.counted
            plan.counted = counted
            input_ids, mu = input_ids[:, cut:], mu[:, cut:]
        head, memories = self.decode_chunk(input_ids, mu, cache, plan, hidden_states)
        return head, memories, prefiller_memories

    def skippable_columns(self, length: int, valid, cache) -> int:
        """Leading columns of a prefiller prompt whose P outputs reach neither the last position nor the cache.
        Fed Q's memories, P has no recurrence over the prompt, so its layer i at a column depends only on the
        `left_i` columns before it (its window) through each layer below, and its first input on the token before
        (smear): started cold `1 + sum(left)` columns before the last one, P's last output and every layer's cached
        window (the last `left_i` keys, exact from `1 + sum(left_j, j < i)` columns in) come out as from the whole
        prompt. 0 (nothing skipped) unless those columns are real tokens in every row, and never when recording for
        rollback or compiling (a host check)."""
        cut = length - 2 - sum(self.config.decoder_windows)
        if cut <= 0 or (cache is not None and cache.recording) or torch.compiler.is_compiling():
            return 0
        if valid is not None and not bool(valid[:, cut:].all()):
            return 0
        return cut

    def prefill_then_decode(self, input_ids, valid, cache, prompt: int, hidden_states=None):
        """A first forward that carries more than the prompt (assisted decoding: the prompt and the first drafts):
        the prefiller reads the first `prompt` tokens only, the rest is decoded recurrently by P as plain
        generation decodes it, so the drafts are verified exactly."""
        def cut(tensor, begin, end=None):
            return None if tensor is None else tensor[:, begin:end]

        prompt_states, draft_states = ([], []) if hidden_states is not None else (None, None)
        prompt_valid = cut(valid, 0, prompt)
        head, memories, prefiller_memories = self.prefill(
            input_ids[:, :prompt], prompt_valid, cache, cache.forward_step(prompt_valid, prompt), prompt_states)
        draft_head, draft_memories = self.recurrent(input_ids[:, prompt:], cache, cut(valid, prompt), draft_states)
        if hidden_states is not None:
            hidden_states.extend(torch.cat(pair, dim=1) for pair in zip(prompt_states, draft_states))
        return torch.cat([head, draft_head], dim=1), torch.cat([memories, draft_memories], dim=1), prefiller_memories

    @torch.compiler.disable
    def prepare_step(self, cache: MaglevCache, input_ids, attention_mask=None, position_ids=None, inputs_embeds=None,
                     **kwargs) -> Step | None:
        """The step of the next forward on `cache` when it runs on tensors alone - a decoding step (`TokenStep`: one
        token per row on a cache that has read tokens) or a "prefiller" prompt (`PrefillStep`: several tokens on an
        empty cache, Q reading them) - in eval mode and not recording for rollback, with its host side done (the
        input checks, the rows' real tokens, the column count, a decoding step's ring masks and slots) and parked on
        the cache (`cache.prepared_step`, replacing an earlier preparation) for that forward to take, so that it reads
        tensors only and traces as one graph. None for any other forward (the general path; `inputs_embeds` and
        `kwargs` are refused there). generate() runs it before each forward
        (`MaglevForCausalLM.prepare_inputs_for_generation`); a forward not prepared runs it itself."""
        if self.training or not isinstance(cache, MaglevCache) or cache.recording or cache.prompt_length is not None \
                or inputs_embeds is not None or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            return None
        batch, length = input_ids.shape
        decode = length == 1 and cache.columns > 0
        if not decode and not (self.config.use_memory and self.uses_prefiller(False, cache.columns, length)):
            return None  # other forwards take the general path (a recurrent prompt runs Python over its tokens)
        check_input_ids(input_ids, None, self.config.vocab_size, cache)
        check_cache(cache, MaglevCache, self.config)
        if not decode and packed_documents(position_ids, attention_mask, {}, batch, length, "Maglev") is not None:
            return None  # the general forward refuses a packed batch on a cache
        cache.prepare(batch, memories_like(self), self.memory_init)  # new rows, or refuses another batch size
        valid = real_tokens(attention_mask, batch, length, cache.columns, input_ids.device)
        if position_ids is not None:
            self.check_positions(position_ids, cache, valid, input_ids)
        return cache.prepare_columns(valid, length)

    def prefill_step(self, input_ids: torch.Tensor, cache: MaglevCache, step: PrefillStep,
                     output_hidden_states: bool | None = None) -> MaglevModelOutput:
        """A prepared "prefiller" prompt (`prepare_step`): Q reads it, P runs on it in parallel (`prefill`), tensors
        only. A compiled forward traces it as one graph while the prompt fits one query block (QUERY_BLOCK plus
        the window; longer prompts are cut into blocks where the keys they reach are read on the host)."""
        hidden_states = [] if config_default(output_hidden_states, self.config, "output_hidden_states") else None
        plan = ChunkStep(cache.positions, step.valid, input_ids.shape[1])  # its length: the input's
        plan.counted = True
        head, memories, prefiller_memories = self.prefill(input_ids, plan.valid, cache, plan, hidden_states,
                                                          last_only=self.last_position_only and hidden_states is None)
        if hidden_states is not None:
            hidden_states.append(head)
        return MaglevModelOutput(
            last_hidden_state=head,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            memories=memories,
            prefiller_memories=prefiller_memories,
            **{CACHE_NAME: cache},
        )

    def forward_mode(self, lifted: bool | None, memory_given: bool, start: int, length: int) -> str:
        """The one place a forward's mode (FORWARD_MODES) is chosen, from the caller's switches - `lifted`
        (None: training mode with `config.training_forward == "lifted"`), given `memory_inputs` - and where the
        cache stands (`start` tokens read before, `length` now)."""
        if lifted is None:
            lifted = self.training and self.config.training_forward == "lifted"
        if not self.config.use_memory:
            return "no_memory"
        if memory_given:
            return "given_memory"
        if self.uses_prefiller(lifted, start, length):
            return "lifted" if lifted else "prefill"
        return "recurrent"

    def uses_prefiller(self, lifted: bool, start: int, length: int) -> bool:
        """Q reads a fresh sequence for lifted training, and in "prefiller" mode the prompt: the first forward
        on an empty cache. Every later step - decoding, continuation, chunked prefill after the first
        chunk, assisted verification - runs recurrently with P's own memory."""
        if start > 0:
            return False
        if lifted:
            return self.config.has_prefiller
        return self.config.memory_prefill == "prefiller" and length > 1

    def check_positions(self, position_ids, cache: MaglevCache | None, valid, input_ids: torch.Tensor) -> None:
        """Maglev's positions are each row's count of real tokens before (as generate() passes them): its
        windows and its memory run over consecutive tokens, so other position_ids are refused."""
        batch, length = input_ids.shape
        start = cache.positions if cache is not None else input_ids.new_zeros(batch)
        own = query_positions(start, valid, length)
        if check_position_ids(position_ids, own, valid, batch, "Maglev", "memory"):
            raise ValueError("position_ids differ from Maglev's own positions (each row's count of real tokens "
                             "before, cached ones included): its sliding windows and recurrent memory run over "
                             "consecutive tokens, so positions cannot skip or shift. Leave position_ids unset.")

    # ----- forward ------------------------------------------------------------------------------
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MaglevCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        lifted: bool | None = None,
        memory_inputs: torch.Tensor | None = None,
        **kwargs,
    ) -> MaglevModelOutput:
        """One of FORWARD_MODES, chosen by `forward_mode`: `lifted` (default: in training mode, unless
        `config.training_forward` is "recurrent") runs lifted parallel training when the prefiller is kept;
        `memory_inputs` (tests, research) runs P in parallel on the given `mu` (`general_forward`). A decoding step
        (one token per row on a cache that has read tokens) runs in `decode_step`, a "prefiller" prompt in
        `prefill_step`, as the `Step` prepared for them (`prepare_step`: input checks, positions, ring masks and
        slots done first) says.

        Padding (attention_mask == 0, anywhere) is skipped per row; without a mask every token is real
        and the model is strictly causal (right padding needs no mask). `position_ids`, when given, must be
        the model's own (`check_positions`). A packed batch (position_ids restarting at 0, or
        `cu_seq_lens_q`/`seq_idx`) runs each document as if alone in its row (`packed_forward`)."""
        cache = take_cache(past_key_values, kwargs.pop("cache", None))
        refuse_attention_weights(output_attentions, self.config, MAGLEV_NO_WEIGHTS)
        # a decode step or a "prefiller" prompt, prepared by generate() or here, runs tensors only (one graph when
        # compiled)
        plain = use_cache is not False and memory_inputs is None and inputs_embeds is None and not lifted \
            and not boundary_kwargs(kwargs)
        prepared = cache.prepared_step if isinstance(cache, MaglevCache) else None
        if prepared is None and plain and not self.training:
            prepared = self.prepare_step(cache, input_ids, attention_mask, position_ids)
        if not plain or prepared is None:
            if prepared is not None:  # inputs a prepared step does not take: the general path counts its own columns
                cache.cancel_prepared_step()
            return self.general_forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                                        output_attentions, output_hidden_states, lifted, memory_inputs, kwargs)
        return cache.take_prepared_step().run(self, input_ids, cache, output_hidden_states)

    def decode_step(self, input_ids: torch.Tensor, cache: MaglevCache, step: TokenStep,
                    output_hidden_states: bool | None = None) -> MaglevModelOutput:
        """A prepared decoding step: P on one token per row fed its row's memory, the rings written in place; its
        positions, ring masks and slots were made with the step (`prepare_step`). The same computation as `recurrent`
        (memory off: `decode_chunk`) for one token, on [B, hidden] (fewer reshapes around every product)."""
        config = self.config
        x0, raw = self.embed(input_ids, cache.previous_embedding, step.valid)
        values = self.value_embeddings_for(input_ids[:, 0], x0.dtype)
        rotary = self.rotary_for(step.query_positions, x0.dtype)
        memory = cache.last_memory[:, 0] if config.use_memory else None
        x0 = x0[:, 0]
        if memory is not None and self.memory_residual_proj is not None:
            x0 = x0 + self.memory_residual_proj(memory)
        hidden_states = [] if config_default(output_hidden_states, config, "output_hidden_states") else None
        x, backout, source = x0, None, None
        for i, layer in enumerate(self.layers):
            if self.residual_lambdas is not None:
                x = self.residual_lambdas[i] * x + self.x0_lambdas[i] * x0
            if hidden_states is not None:
                hidden_states.append(x[:, None])
            x = layer(x, values[i], memory, rotary, config.decoder_windows[i], cache.layers[i], step)
            if self.backout_lambda is not None and i == config.backout_layer:
                backout = x
            if i == config.memory_source_layer:
                source = x
        if backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * backout
        head, memories = self.read_out(x, x if source is None else source)
        head, memories = head[:, None], memories[:, None]
        cache.finish_forward(step, raw, None if memory is None else memories)
        return MaglevModelOutput(
            last_hidden_state=head,
            hidden_states=None if hidden_states is None else (*hidden_states, head),
            memories=memories if config.use_memory else None,
            **{CACHE_NAME: cache},
        )

    def general_forward(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                        output_attentions, output_hidden_states, lifted, memory_inputs, kwargs) -> MaglevModelOutput:
        """`forward` of all but a prepared step: packed batches, training, scoring, prompts and chunks on a cache."""
        documents = packed_documents(position_ids, attention_mask, kwargs, *input_ids.shape[:2], "Maglev") \
            if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else None
        if documents is not None:
            refuse_packed_cache(use_cache, cache, "Maglev")
            return self.packed_forward(documents, input_ids, output_attentions, output_hidden_states, lifted,
                                       memory_inputs)
        config = self.config
        check_input_ids(input_ids, inputs_embeds, config.vocab_size, cache)
        if cache is not None:
            check_cache(cache, MaglevCache, config)
        output_hidden_states = config_default(output_hidden_states, config, "output_hidden_states")
        use_cache = (config.use_cache and not self.training) if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = MaglevCache(config)
        if not use_cache:
            cache = None
        batch, length = input_ids.shape
        start = 0 if cache is None else cache.columns
        valid = real_tokens(attention_mask, batch, length, start, input_ids.device)
        memory_init = self.memory_init if config.use_memory else None
        if cache is not None:
            cache.prepare(batch, memories_like(self), memory_init)
        if position_ids is not None:
            self.check_positions(position_ids, cache, valid, input_ids)
        mode = self.forward_mode(lifted, memory_inputs is not None, start, length)
        hidden_states = [] if output_hidden_states else None
        prefiller_memories = consistency_loss = pass_heads = None

        def context():
            if cache is not None:
                return cache.forward_step(valid, length)
            return ChunkStep(input_ids.new_zeros(batch), valid, length)

        if mode == "no_memory":
            head, memories = self.decode_chunk(input_ids, None, cache, context(), hidden_states)
        elif mode == "given_memory":
            head, memories = self.decode_chunk(input_ids, memory_inputs.to(self.dtype), cache, context(),
                                               hidden_states)
        elif mode == "lifted":
            def decoder(mu, last):  # P in parallel; only the last pass writes the cache and the hidden states
                plan = context() if last else ChunkStep(input_ids.new_zeros(batch), valid, length)
                return self.decode_chunk(input_ids, mu, cache if last else None, plan,
                                         hidden_states if last else None)
            passes = 1 + (config.memory_self_feed_steps if self.training else 0)
            pass_heads, memories, prefiller_memories, consistency_loss = lifted_passes(
                partial(self.prefiller_memories, input_ids, valid), decoder,
                partial(self.shifted_memories, first=None, valid=valid), config, current_schedule(self), passes,
                valid, config.memory_noise_std if self.training else 0.0)
            head = pass_heads[-1]
        elif mode == "prefill":
            prompt = length if cache is None else cache.take_prompt_length(length)
            if prompt == length:
                head, memories, prefiller_memories = self.prefill(
                    input_ids, valid, cache, context(), hidden_states,
                    last_only=self.last_position_only and hidden_states is None)
            else:
                head, memories, prefiller_memories = self.prefill_then_decode(input_ids, valid, cache, prompt,
                                                                              hidden_states)
        else:
            recurrent_cache = cache
            if recurrent_cache is None:
                recurrent_cache = MaglevCache(config)
                recurrent_cache.prepare(batch, memories_like(self), memory_init)
            head, memories = self.recurrent(input_ids, recurrent_cache, valid, hidden_states)

        if hidden_states is not None:
            hidden_states.append(head)
        return MaglevModelOutput(
            last_hidden_state=head,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            memories=memories if config.use_memory else None,
            prefiller_memories=prefiller_memories,
            consistency_loss=consistency_loss,
            pass_hidden_states=tuple(pass_heads) if pass_heads is not None and len(pass_heads) > 1 else None,
            **{CACHE_NAME: cache},
        )

    def packed_forward(self, documents, input_ids, output_attentions, output_hidden_states, lifted, memory_inputs):
        """A packed batch: its documents in length buckets, each bucket run as an unpacked right-padded batch (the
        windows, memory from memory_init, smear, value embeddings, rotary positions, the prefiller Q and every
        self-fed pass start at each document's first token), the outputs scattered back to the packed layout;
        the consistency loss is the mean over all real tokens, as one padded batch of the documents has it."""
        batch, length = input_ids.shape
        outputs, indices, counts = [], [], []
        for bucket in length_buckets(documents, 1):
            width, index = bucket_index(bucket, 1, input_ids.device)
            part = gather_bucket(input_ids, len(bucket), width, index)
            mu = None if memory_inputs is None else gather_bucket(memory_inputs, len(bucket), width, index)
            outputs.append(self(input_ids=part, attention_mask=bucket_mask(len(bucket), width, index, part.device),
                                use_cache=False, output_attentions=output_attentions,
                                output_hidden_states=output_hidden_states, lifted=lifted, memory_inputs=mu,
                                return_dict=True))
            indices.append(index)
            counts.append(sum(doc.length for doc in bucket))
        return MaglevModelOutput(**scatter_outputs(outputs, indices, counts, batch, length))


def kept_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits are computed: the last `logits_to_keep` (0 = all) or the given indices."""
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return hidden[:, logits_to_keep]


def memories_like(model: MaglevModel) -> torch.Tensor:
    """An empty tensor with the model's device and dtype (what new cache rows are made like)."""
    return local_tensor(model.embed_tokens.weight).new_empty(0, dtype=model.dtype)  # a plain tensor under TP


def check_input_ids(input_ids, inputs_embeds, vocab_size: int, cache) -> None:
    """Clear errors for inputs the model cannot read (Maglev reads token ids only)."""
    if inputs_embeds is not None:
        if input_ids is not None:
            raise ValueError("pass either input_ids or inputs_embeds, not both (Maglev reads input_ids only)")
        raise ValueError("Maglev needs input_ids (value embeddings and smear read token ids); "
                         "inputs_embeds is not supported, so PEFT prompt tuning and P-tuning (which feed "
                         "inputs_embeds) do not apply to Maglev: use LoRA (peft.LoraConfig(target_modules='all-linear'))")
    if input_ids is None:
        raise ValueError("input_ids is required")
    check_token_ids(input_ids, vocab_size, cache)


@torch.compiler.disable
def run_uncompiled(module: nn.Module, **kwargs):
    """An inference forward of the base model outside compiled graphs, for all but prepared steps (decode steps,
    prefiller prompts): a recurrent prompt runs Python over its rows and tokens, which would break into many
    graphs; the head stays compilable."""
    return module(**kwargs)


class MaglevForCausalLM(MaglevPreTrainedModel, OwnCacheGenerationMixin, GenerationMixin):
    """Maglev with nanochat's untied, soft-capped language-model head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # when config.tie_word_embeddings
    _tp_plan = {"lm_head": "colwise_gather_output"}

    @property
    def cache_class(self) -> type:
        """The cache generate() makes (read when used: the generated file defines it further down)."""
        return MaglevCache

    float32_logits = True  # nanochat's head: float32 logits, then the cap

    def __init__(self, config: MaglevConfig):
        super().__init__(config)
        self.model = MaglevModel(config)
        # exactly vocab_size rows (config.head_rows) unless loaded from a padded save: libraries read this
        # weight directly (TRL's fused log-prob head) and would give padded rows probability mass
        self.lm_head = with_init(nn.Linear(config.hidden_size, config.head_rows, bias=False), "normal", 0.001)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' from_pretrained; a head saved with padded rows (before `lm_head_padded`) is unpadded."""
        model = super().from_pretrained(*args, **kwargs)
        if isinstance(model, MaglevForCausalLM):  # output_loading_info=True returns a tuple
            model.unpad_lm_head()
        elif isinstance(model, tuple) and isinstance(model[0], MaglevForCausalLM):
            model[0].unpad_lm_head()
        return model

    def unpad_lm_head(self) -> bool:
        """Drop lm_head's padded rows (and a tied embedding's), keeping the real ids' rows; returns whether it did.
        Heads whose weight is not a plain local float tensor (sharded, offloaded, on the meta device, quantized by a
        user's skip list that left the head out) stay as they are."""
        weight = self.lm_head.weight
        rows = self.config.vocab_size
        if weight.shape[0] == rows:
            self.config.lm_head_padded = False
            return False
        if weight.shape[0] < rows:  # a shard of the head (tensor parallelism): its rows are not the padding
            return False
        if (type(weight.data) is not torch.Tensor or not weight.is_floating_point() or weight.is_meta
                or hasattr(self.lm_head, "_hf_hook")):
            return False
        tied = self.config.tie_word_embeddings
        head = with_init(nn.Linear(weight.shape[1], rows, bias=False, device=weight.device, dtype=weight.dtype),
                         self.lm_head.init_kind, self.lm_head.init_value)
        head.weight = nn.Parameter(weight.detach()[:rows].clone(), requires_grad=weight.requires_grad)
        head._is_hf_initialized = True
        self.lm_head = head
        if tied:
            old = self.get_input_embeddings()
            table = with_init(nn.Embedding(rows, old.weight.shape[1], device=weight.device, dtype=old.weight.dtype),
                              old.init_kind, old.init_value)
            table.weight = head.weight
            table._is_hf_initialized = True
            self.set_input_embeddings(table)
        self.config.lm_head_padded = False
        return True

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def set_training_step(self, step: int) -> None:
        """Set the training schedules (ramps, teacher switch) at optimizer step `step` (on the base model)."""
        self.model.set_training_step(step)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head, padded rows sliced away, float32, tanh soft-capping (nanochat)."""
        logits = self.lm_head(hidden)[..., : self.config.vocab_size].float()
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: MaglevCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        memory_inputs: torch.Tensor | None = None,
        lifted: bool | None = None,
        **kwargs,
    ) -> MaglevCausalLMOutput:
        """In training mode the training objective: lifted parallel training with the consistency loss, or with
        `config.training_forward="recurrent"` P alone fed its own memory (what generate() samples from). In eval
        mode inference with `config.memory_prefill`, as generate() runs it; labels only add the loss of those
        logits, so an evaluation loss measures the model generate() runs. `lifted=True` asks for the lifted
        objective in either mode, `lifted=False` for the inference forward. `return_dict=False` (argument or
        config) returns the tuple."""
        cache = take_cache(past_key_values, kwargs.pop("cache", None))
        kwargs.pop("cache_position", None)
        if lifted is None:
            lifted = self.training and self.config.training_forward == "lifted"
        training = self.training or lifted
        prepared = isinstance(cache, MaglevCache) and cache.prepared_step is not None  # a prepared step: one graph
        last_only = isinstance(logits_to_keep, int) and logits_to_keep == 1 and labels is None and not training \
            and not torch.compiler.is_compiling()
        if last_only:
            self.model.last_position_only = True
        # the base model outside a compiled graph, unless training or a prepared step (their forwards trace as one)
        base = self.model if training or prepared else partial(run_uncompiled, self.model)
        try:
            outputs = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                           output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                           lifted=lifted, memory_inputs=memory_inputs, return_dict=True, **boundary_kwargs(kwargs))
        finally:
            if last_only:
                self.model.last_position_only = False
        logits, last_pass_loss = self.logits_and_loss(kept_positions(outputs.last_hidden_state, logits_to_keep),
                                                      labels, **kwargs)
        loss = lm_loss = None
        if labels is not None:
            # self-fed passes each predict the sequence: the language-model loss is their mean
            earlier = [] if outputs.pass_hidden_states is None else outputs.pass_hidden_states[:-1]
            pass_losses = [self.head_loss(kept_positions(h, logits_to_keep), labels, **kwargs) for h in earlier]
            lm_loss = (sum(pass_losses) + last_pass_loss) / (len(pass_losses) + 1)
            loss = lm_loss
            if outputs.consistency_loss is not None:
                loss = lm_loss + current_schedule(self.model).consistency_weight * self._accumulation_share(
                    outputs.consistency_loss, labels, kwargs.get("num_items_in_batch")
                )
        return MaglevCausalLMOutput(
            loss=loss,
            lm_loss=lm_loss,
            consistency_loss=outputs.consistency_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )

    @staticmethod
    def _accumulation_share(
        consistency_loss: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None
    ) -> torch.Tensor:
        """The consistency mean weighted by this micro-batch's share of the supervised tokens.

        Trainer adds the losses of accumulation steps (and processes) and the language-model loss
        is already a sum divided by `num_items_in_batch`; weighting each micro-batch's mean by its
        share keeps the total equal to one large batch's loss.
        """
        if num_items_in_batch is None:
            return consistency_loss
        supervised = (labels[..., 1:] != -100).sum()
        return consistency_loss * supervised.to(consistency_loss.dtype) / num_items_in_batch

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, cache=None, past_key_values=None,
                                      **kwargs) -> dict:
        """transformers' inputs for the next forward; the host side of a decode step or a prefiller prompt runs here,
        before the forward (`MaglevModel.prepare_step`), so that a compiled forward traces it as one graph. The
        cache is named in the signature, as generate() checks its arguments against it (`cache` from 5.24 on)."""
        caches = {"cache": cache, "past_key_values": past_key_values}
        inputs = super().prepare_inputs_for_generation(
            input_ids, *args, **{name: value for name, value in caches.items() if value is not None}, **kwargs)
        cache = inputs.get(GENERATE_CACHE_KWARG)
        if isinstance(cache, MaglevCache):
            self.model.prepare_step(cache, inputs.get("input_ids"), inputs.get("attention_mask"),
                                    inputs.get("position_ids"), inputs.get("inputs_embeds"))
        return inputs

    def _assisted_decoding(self, input_ids: torch.LongTensor, *args, **model_kwargs):
        """transformers' assisted decoding, whose first forward reads the prompt and the first drafts together:
        the cache is told where the prompt ends, so that in "prefiller" mode Q reads the prompt only."""
        cache = model_kwargs.get(GENERATE_CACHE_KWARG)
        if self.config.memory_prefill == "prefiller" and isinstance(cache, MaglevCache) and cache.columns == 0:
            cache.prompt_length = input_ids.shape[1]
        return super()._assisted_decoding(input_ids, *args, **model_kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """A MaglevCache for generate() (OwnCacheGenerationMixin); the prefiller reads a prompt in one piece."""
        if self.config.memory_prefill == "prefiller" and getattr(generation_config, "prefill_chunk_size", None):
            raise ValueError("prefill_chunk_size cannot be used with memory_prefill='prefiller': the prefiller reads "
                             "the whole prompt in one forward (later chunks would run recurrently)")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


__all__ = ["MaglevCausalLMOutput", "MaglevForCausalLM", "MaglevModel", "MaglevModelOutput", "MaglevPreTrainedModel"]
