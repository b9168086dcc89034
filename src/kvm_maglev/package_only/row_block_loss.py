"""The causal-LM loss of transformers (`ForCausalLMLoss`) computed in blocks of rows, for long training sequences.

`F.cross_entropy` keeps the log-probabilities from the forward and builds, in the backward, a zero-filled
gradient and then the logits' gradient: three [tokens, vocab] float32 tensors besides the logits (1.6 GB each
at 8k tokens and a 50k vocabulary). Here the forward keeps one log-sum-exp per row and the backward writes
softmax - one-hot into one tensor, a block of rows at a time. Given the hidden states and the head's weight
instead of the logits, `row_block_logits_and_loss` makes the logits and the loss together and its backward
goes from each block of rows straight to the gradients of the hidden states and the weight: no [tokens,
vocab] gradient at all. For a training pass whose logits nobody reads, `row_block_head_loss` never holds
the logits either. Same loss and gradients up to float rounding; transformers' own function is the
reference (tests/models/test_row_block_loss.py). The package's models use it through `RowBlockLossMixin`;
a Hub folder's models compute transformers' loss (`HeadLossMixin` in models/common/conventions.py).
"""

from __future__ import annotations

import torch

from ..models.speedups.onednn_linear import OneDNNLinear

# elements of one block's float32 temporaries (16 MB): small enough to be reused from the heap, not mapped anew
BLOCK_ELEMENTS = 1 << 22
# the same for blocks whose rows also feed weight-gradient products (64 MB): more rows keep those products efficient
HEAD_BLOCK_ELEMENTS = 1 << 24


def row_blocks(rows: int, columns: int, elements: int | None = None) -> list[slice]:
    """Slices of at most `elements` (default BLOCK_ELEMENTS) elements, at least one row each, covering `rows` rows."""
    step = max(1, (elements or BLOCK_ELEMENTS) // max(1, columns))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class RowBlockCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `logits` [N, V] against `targets` [N], rows whose target is `ignore_index` left out."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        total, safe_targets, kept, log_normalizers = summed_cross_entropy(logits, targets, ignore_index)
        ctx.save_for_backward(logits, safe_targets, kept, log_normalizers)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, safe_targets, kept, log_normalizers = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        row_scale = kept.to(torch.float32) * grad_total.float()
        for rows in row_blocks(*logits.shape):
            block = (logits[rows], log_normalizers[rows], safe_targets[rows], row_scale[rows])
            if grad.dtype == torch.float32:
                softmax_gradient_(grad[rows], *block)
            else:
                grad[rows] = softmax_gradient_(torch.empty(grad[rows].shape, dtype=torch.float32), *block)
        return grad, None, None


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int) -> tuple[torch.Tensor, ...]:
    """The summed cross-entropy of `logits` [N, V] (log-sum-exp a block of rows at a time, in float32) and what its
    gradient needs: the targets with ignored ones set to 0, the mask of kept rows, each row's log-sum-exp."""
    kept = targets != ignore_index
    safe_targets = torch.where(kept, targets, torch.zeros_like(targets))
    log_normalizers = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in row_blocks(*logits.shape):
        log_normalizers[rows] = torch.logsumexp(logits[rows].float(), dim=-1)
    target_logits = logits.gather(1, safe_targets[:, None]).squeeze(1).float()
    return ((log_normalizers - target_logits) * kept).sum(), safe_targets, kept, log_normalizers


def softmax_gradient_(out: torch.Tensor, logits: torch.Tensor, log_normalizers: torch.Tensor,
                      targets: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Write into `out` (float32) the gradient of a block of rows' summed cross-entropy with respect to their
    logits, (softmax - one-hot) scaled per row, and return it."""
    torch.sub(logits, log_normalizers[:, None], out=out).exp_()
    out.scatter_add_(1, targets[:, None], out.new_full((out.shape[0], 1), -1.0))
    return out.mul_(row_scale[:, None])


def row_block_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` with its arguments and meaning: labels shifted inside (unless
    `shift_labels` are given), `ignore_index` left out, the sum over `num_items_in_batch` when given, else
    the mean over the kept tokens."""
    targets = flat_targets(labels, shift_labels, ignore_index, logits.device)
    total = RowBlockCrossEntropy.apply(logits.reshape(-1, vocab_size), targets, ignore_index)
    return mean_or_share(total, targets, ignore_index, num_items_in_batch)


def flat_targets(labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int,
                 device: torch.device) -> torch.Tensor:
    """Each position's target, flattened: `shift_labels` when given, else the labels shifted left by one."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1).to(device)


def mean_or_share(total: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                  num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """The summed loss over `num_items_in_batch` when given (Trainer's accumulation), else over the kept tokens."""
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class RowBlockHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of the logits `softcap(hidden @ weight[:vocab_size].T)` (float32) without holding
    them: each block of rows' logits are made, read and dropped, and the gradients of `hidden` and `weight`
    are formed in the same pass (the loss is a scalar: the backward only scales them)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                softcap: float | None, ignore_index: int) -> torch.Tensor:
        kept = targets != ignore_index
        safe_targets = torch.where(kept, targets, torch.zeros_like(targets))
        head = weight[:vocab_size]
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if wants_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in row_blocks(hidden.shape[0], vocab_size, HEAD_BLOCK_ELEMENTS):
            logits = (hidden[rows] @ head.T).float()
            if softcap is not None:
                logits = torch.tanh(logits.div_(softcap)).mul_(softcap)
            log_normalizers = torch.logsumexp(logits, dim=-1)
            target_logits = logits.gather(1, safe_targets[rows, None]).squeeze(1)
            total += ((log_normalizers - target_logits) * kept[rows]).sum()
            if wants_hidden or wants_weight:
                grad = softmax_gradient_(torch.empty_like(logits), logits, log_normalizers, safe_targets[rows],
                                         kept[rows].to(torch.float32))
                if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - (capped / c)^2
                    grad.mul_(1.0 - logits.div_(softcap).square_())
                if wants_hidden:
                    grad_hidden[rows] = grad.to(hidden.dtype) @ head
                if wants_weight:
                    torch.addmm(grad_head, grad.T, hidden[rows].float(), out=grad_head)
        grad_weight = padded_weight_grad(grad_head, weight) if wants_weight else None
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_total.to(grad_hidden.dtype),
                None if grad_weight is None else grad_weight * grad_total.to(grad_weight.dtype), None, None, None, None)


def is_plain_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is an nn.Linear (or the models' OneDNNLinear, nn.Linear's product under autograd) whose
    weight can be used outside its forward: no adapter class, no hooks (DeepSpeed ZeRO-3 gathers weights in
    them, accelerate moves them), not a sharded tensor."""
    return (type(module) in (torch.nn.Linear, OneDNNLinear) and not module._forward_hooks
            and not module._forward_pre_hooks and not hasattr(module, "_hf_hook")
            and type(module.weight.data) is torch.Tensor)


class RowBlockLogitsCrossEntropy(torch.autograd.Function):
    """The logits `softcap(hidden @ weight[:vocab_size].T)` [N, V] and their summed cross-entropy against `targets`
    [N]. The backward takes the loss's gradient (and any the logits got elsewhere) to `hidden` and `weight` a
    block of rows at a time, in the dtype the forward's product ran in (autocast's), the weight's gradient
    summed in float32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                softcap: float | None, float32_logits: bool, ignore_index: int):
        ctx.set_materialize_grads(False)
        logits = torch.nn.functional.linear(hidden, weight[:vocab_size])
        ctx.product_dtype = logits.dtype
        if float32_logits:
            logits = logits.float()
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        total, safe_targets, kept, log_normalizers = summed_cross_entropy(logits, targets, ignore_index)
        ctx.save_for_backward(hidden, weight, logits, safe_targets, kept, log_normalizers)
        ctx.vocab_size, ctx.softcap = vocab_size, softcap
        return logits, total

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor | None, grad_total: torch.Tensor | None):
        hidden, weight, logits, safe_targets, kept, log_normalizers = ctx.saved_tensors
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (wants_hidden or wants_weight) or (grad_logits is None and grad_total is None):
            return None, None, None, None, None, None, None
        head = weight[: ctx.vocab_size].to(ctx.product_dtype)
        inputs = hidden.to(ctx.product_dtype)
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if wants_weight else None
        row_scale = None if grad_total is None else kept.to(torch.float32) * grad_total.float()
        blocks = row_blocks(logits.shape[0], logits.shape[1], HEAD_BLOCK_ELEMENTS)
        # one block's buffers, reused: a fresh mapping for every block would be faulted in page by page again
        buffer = torch.empty((blocks[0].stop, logits.shape[1]), dtype=torch.float32, device=logits.device)
        cap_buffer = torch.empty_like(buffer) if ctx.softcap is not None else None
        for rows in blocks:
            grad = buffer[: rows.stop - rows.start]
            if row_scale is None:
                grad.zero_()
            else:
                softmax_gradient_(grad, logits[rows], log_normalizers[rows], safe_targets[rows], row_scale[rows])
            if grad_logits is not None:
                grad.add_(grad_logits[rows])
            if ctx.softcap is not None:  # d(c tanh(x / c)) / dx = 1 - (capped / c)^2
                cap = torch.div(logits[rows], ctx.softcap, out=cap_buffer[: rows.stop - rows.start])
                grad.mul_(cap.square_().neg_().add_(1.0))
            product_grad = grad.to(ctx.product_dtype)
            if wants_hidden:
                grad_hidden[rows] = product_grad @ head
            if wants_weight:
                if product_grad.dtype == torch.float32:
                    torch.addmm(grad_head, product_grad.T, inputs[rows], out=grad_head)
                else:
                    grad_head += product_grad.T @ inputs[rows]
        grad_weight = padded_weight_grad(grad_head, weight) if wants_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None


def padded_weight_grad(grad_head: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gradient of the whole head weight from that of its first rows (padding rows get none)."""
    if grad_head.shape[0] == weight.shape[0]:
        return grad_head.to(weight.dtype)
    grad_weight = torch.zeros_like(weight)
    grad_weight[: grad_head.shape[0]] = grad_head
    return grad_weight


def row_block_logits_and_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    softcap: float | None = None,
    float32_logits: bool = False,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits `softcap(hidden @ weight[:vocab_size].T)` (made float32 before the cap if `float32_logits`) and
    `row_block_causal_lm_loss` of them, for a pass that returns its logits: the same values, and a backward
    that makes no [tokens, vocab] gradient."""
    targets = flat_targets(labels, shift_labels, ignore_index, hidden.device)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if targets.numel() != flat_hidden.shape[0]:
        raise ValueError(f"labels give {targets.numel()} targets for {flat_hidden.shape[0]} positions with logits")
    logits, total = RowBlockLogitsCrossEntropy.apply(flat_hidden, weight, targets, vocab_size, softcap,
                                                     float32_logits, ignore_index)
    loss = mean_or_share(total, targets, ignore_index, num_items_in_batch)
    return logits.view(*hidden.shape[:-1], vocab_size), loss


def row_block_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`row_block_causal_lm_loss` of the logits `softcap(hidden @ weight[:vocab_size].T)`, computed from the
    hidden states: for a training pass whose logits nobody reads (Maglev's self-fed passes)."""
    targets = flat_targets(labels, shift_labels, ignore_index, hidden.device)
    total = RowBlockHeadCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets, vocab_size,
                                           softcap, ignore_index)
    return mean_or_share(total, targets, ignore_index, num_items_in_batch)


class RowBlockLossMixin:
    """Put before the model's `HeadLossMixin`: the causal-LM loss transformers would pick is computed in row blocks;
    a loss the user sets (`model.loss_function = f`) or another `model.loss_type` is transformers' to resolve.
    A model class whose `logits` makes the head's logits float32 before the cap says so with `float32_logits = True`."""

    @property
    def loss_function(self):
        if hasattr(self, "_loss_function") or getattr(self, "loss_type", None) != "ForCausalLM":
            return super().loss_function
        return row_block_causal_lm_loss

    @loss_function.setter
    def loss_function(self, value):
        self._loss_function = value

    def reads_head_in_row_blocks(self) -> bool:
        """Whether the loss may start from the hidden states and the head's weight: the loss is the default one
        and the head a plain linear layer (no adapter, hooks or sharding)."""
        return self.loss_function is row_block_causal_lm_loss and is_plain_linear(self.get_output_embeddings())

    def logits_and_loss(self, hidden: torch.Tensor, labels: torch.Tensor | None,
                        **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's `logits` and, given labels, the loss. With the default loss and a plain linear head both
        come from `row_block_logits_and_loss`: the same values, and no [tokens, vocabulary] gradient."""
        if labels is not None and self.reads_head_in_row_blocks():
            return row_block_logits_and_loss(hidden, self.get_output_embeddings().weight, labels,
                                             self.config.vocab_size, self.config.logit_softcap or None,
                                             getattr(self, "float32_logits", False), **kwargs)
        return super().logits_and_loss(hidden, labels, **kwargs)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        """The loss of a pass whose logits are not returned (Maglev's self-fed passes): from the hidden states in
        row blocks with the default loss and a plain linear head, never holding the logits."""
        if self.reads_head_in_row_blocks():
            return row_block_head_loss(hidden, self.get_output_embeddings().weight, labels, self.config.vocab_size,
                                       self.config.logit_softcap, **kwargs)
        return super().head_loss(hidden, labels, **kwargs)
