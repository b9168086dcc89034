"""KVM's decoding attention as one Triton kernel: `state_window_attention_torch` of decode_attention_kvm (the
reference it equals), each row's query over its page's live state slots and visible ring slots in one online softmax,
read in place without gathering or concatenating them; float32 accumulation.

decode_attention_kvm's `decoding_attention` picks it where this module imports (Triton is installed) and
`use_triton_kernel`: on CUDA, for tensors it reads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

# The kernel's key blocks hold at most this many products (query heads x keys x head dim) in registers at once.
# Not timed (no GPU lent); compiled for sm_90 without a GPU, blocks of this size took 180-255 registers and spilled
# none (1 head over 64-wide keys: 128 keys; 8 grouped heads over 128-wide: 8), twice the size spilled.
KERNEL_BLOCK_PRODUCTS = 8192
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _absorb_block(queries, key_ptrs, value_ptrs, valid, dim_mask, value_dim_mask, maximum, total, acc):
    """One block of keys folded into the online softmax of a group of query heads: `queries` [G, D] already
    carry scale, temperature and log2(e), so exp2 of their products is the softmax's exponential."""
    keys = tl.load(key_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
    scores = tl.sum(queries[:, None, :] * keys[None, :, :], axis=2)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    new_maximum = tl.maximum(maximum, tl.max(scores, axis=1))
    # while a head has seen no key its maximum is -inf; shifting by 0 then keeps exp2 at 0 instead of NaN
    shift = tl.where(new_maximum == float("-inf"), 0.0, new_maximum)
    rescale = tl.exp2(maximum - shift)
    weights = tl.exp2(scores - shift[:, None])
    values = tl.load(value_ptrs, mask=valid[:, None] & value_dim_mask[None, :], other=0.0).to(tl.float32)
    acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
    return new_maximum, total * rescale + tl.sum(weights, axis=1), acc

@triton.jit
def _state_window_kernel(q_ptr, page_ptr, state_keys_ptr, state_values_ptr, slots_ptr, window_keys_ptr,
                         window_values_ptr, visible_ptr, state_temperature_ptr, window_temperature_ptr, out_ptr,
                         sk_page, sk_head, sk_slot, sv_page, sv_head, sv_slot,
                         wk_page, wk_head, wk_slot, wv_page, wv_head, wv_slot,
                         capacity, ring_size, scale_log2e,
                         GROUPS: tl.constexpr, DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                         STATE_TEMPERATURE: tl.constexpr, WINDOW_TEMPERATURE: tl.constexpr,
                         BLOCK_GROUPS: tl.constexpr, BLOCK_DIM: tl.constexpr, BLOCK_VALUE_DIM: tl.constexpr,
                         BLOCK_KEYS: tl.constexpr):
    """One program per (row, key/value head): the head's group of query heads over the row's live state slots,
    then over its visible ring slots, in one online softmax; output [B, H, Dv]."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    groups = tl.arange(0, BLOCK_GROUPS)
    dims = tl.arange(0, BLOCK_DIM)
    value_dims = tl.arange(0, BLOCK_VALUE_DIM)
    keys_in_block = tl.arange(0, BLOCK_KEYS)
    group_mask, dim_mask, value_dim_mask = groups < GROUPS, dims < DIM, value_dims < VALUE_DIM
    head = kv_head * GROUPS + groups  # query heads [G]
    query_row = row * tl.num_programs(1) * GROUPS + head

    q = tl.load(q_ptr + query_row[:, None] * DIM + dims[None, :], mask=group_mask[:, None] & dim_mask[None, :],
                other=0.0).to(tl.float32) * scale_log2e
    state_q, window_q = q, q
    if STATE_TEMPERATURE:
        state_q = q * tl.load(state_temperature_ptr + head, mask=group_mask, other=0.0).to(tl.float32)[:, None]
    if WINDOW_TEMPERATURE:
        window_q = q * tl.load(window_temperature_ptr + head, mask=group_mask, other=0.0).to(tl.float32)[:, None]

    page = tl.load(page_ptr + row).to(tl.int64)  # int64: offsets into a large page pool overflow int32
    maximum = tl.full((BLOCK_GROUPS,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_GROUPS,), tl.float32)
    acc = tl.zeros((BLOCK_GROUPS, BLOCK_VALUE_DIM), tl.float32)

    # the state: only the row's live slots are visited, not the page's whole capacity
    live = tl.minimum(tl.load(slots_ptr + row).to(tl.int32), capacity)
    key_base = state_keys_ptr + page * sk_page + kv_head * sk_head
    value_base = state_values_ptr + page * sv_page + kv_head * sv_head
    for begin in range(0, live, BLOCK_KEYS):
        slot = begin + keys_in_block
        maximum, total, acc = _absorb_block(
            state_q, key_base + slot[:, None] * sk_slot + dims[None, :],
            value_base + slot[:, None] * sv_slot + value_dims[None, :],
            slot < live, dim_mask, value_dim_mask, maximum, total, acc)

    # the ring: every slot, masked by what this row's query sees
    key_base = window_keys_ptr + page * wk_page + kv_head * wk_head
    value_base = window_values_ptr + page * wv_page + kv_head * wv_head
    for begin in range(0, ring_size, BLOCK_KEYS):
        slot = begin + keys_in_block
        inside = slot < ring_size
        seen = tl.load(visible_ptr + row * ring_size + slot, mask=inside, other=0) != 0
        maximum, total, acc = _absorb_block(
            window_q, key_base + slot[:, None] * wk_slot + dims[None, :],
            value_base + slot[:, None] * wv_slot + value_dims[None, :],
            inside & seen, dim_mask, value_dim_mask, maximum, total, acc)

    out = acc / total[:, None]
    tl.store(out_ptr + query_row[:, None] * VALUE_DIM + value_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=group_mask[:, None] & value_dim_mask[None, :])


def key_block(groups: int, dim: int, value_dim: int) -> int:
    """Keys per block of the kernel: as many as keep a block's products under KERNEL_BLOCK_PRODUCTS, 8 to 128."""
    width = triton.next_power_of_2(groups) * triton.next_power_of_2(max(dim, value_dim))
    return max(8, min(128, KERNEL_BLOCK_PRODUCTS // width))


def kernel_refusal(q: Tensor, state_keys: Tensor, state_values: Tensor, window_keys: Tensor,
                   window_values: Tensor) -> str | None:
    """Why the kernel cannot read these tensors (None: it can): it reads float16, bfloat16 and float32 (float64 takes
    the torch path, which computes in it), with a contiguous last dimension."""
    tensors = dict(q=q, state_keys=state_keys, state_values=state_values, window_keys=window_keys,
                   window_values=window_values)
    for name, tensor in tensors.items():
        if tensor.dtype not in KERNEL_DTYPES:
            return f"the Triton kernel reads float16, bfloat16 or float32, not {name} in {tensor.dtype}"
        if tensor.stride(-1) != 1:
            return f"the Triton kernel reads {name} with a contiguous last dimension"
    return None


def state_window_attention_triton(q: Tensor, page: Tensor | None, state_keys: Tensor, state_values: Tensor,
                                  state_slots: Tensor, window_keys: Tensor, window_values: Tensor,
                                  window_visible: Tensor, state_temperature: Tensor | None,
                                  window_temperature: Tensor | None, scale: float) -> Tensor:
    """`state_window_attention_torch` as one Triton kernel reading the storage in place through `page`, float32
    accumulation; `page` None: row i is page i. Queries [B, H, D], output [B, H, Dv] in the window values' dtype."""
    refusal = kernel_refusal(q, state_keys, state_values, window_keys, window_values)
    if refusal is not None:
        raise ValueError(refusal)
    batch, heads, dim = q.shape
    kv_heads, capacity = state_keys.shape[1], state_keys.shape[2]
    ring_size, value_dim = window_keys.shape[2], window_values.shape[3]
    groups = heads // kv_heads
    out = torch.empty(batch, heads, value_dim, dtype=window_values.dtype, device=q.device)
    if page is None:
        page = torch.arange(batch, device=q.device)
    _state_window_kernel[(batch, kv_heads)](
        q.contiguous(), page, state_keys, state_values, state_slots, window_keys, window_values,
        window_visible.contiguous().view(torch.uint8),  # the same bytes, loaded as 0/1
        q if state_temperature is None else state_temperature.contiguous(),  # unread when None
        q if window_temperature is None else window_temperature.contiguous(), out,
        *state_keys.stride()[:3], *state_values.stride()[:3], *window_keys.stride()[:3], *window_values.stride()[:3],
        capacity, ring_size, scale * math.log2(math.e),
        GROUPS=groups, DIM=dim, VALUE_DIM=value_dim,
        STATE_TEMPERATURE=state_temperature is not None, WINDOW_TEMPERATURE=window_temperature is not None,
        BLOCK_GROUPS=triton.next_power_of_2(groups), BLOCK_DIM=triton.next_power_of_2(dim),
        BLOCK_VALUE_DIM=triton.next_power_of_2(value_dim), BLOCK_KEYS=key_block(groups, dim, value_dim))
    return out


def use_triton_kernel(q: Tensor, state_keys: Tensor, state_values: Tensor, window_keys: Tensor,
                      window_values: Tensor) -> bool:
    """Whether `decoding_attention` picks the kernel: the query is on a CUDA device and the kernel reads these
    tensors (`kernel_refusal`). Otherwise the torch path runs."""
    return q.is_cuda and kernel_refusal(q, state_keys, state_values, window_keys, window_values) is None
