"""Packed batches and the same documents run alone, for the packing exactness tests."""

from __future__ import annotations

import torch


def documents(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Random token documents of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def packed_batch(docs: list[torch.Tensor], rows: int = 1) -> dict:
    """The documents packed into `rows` rows of equal length (as DataCollatorWithFlattening packs them): restarting
    position_ids, and labels with each document's first token -100 so no document predicts across a boundary."""
    per_row = [docs[i::rows] for i in range(rows)]
    ids = [torch.cat(row) for row in per_row]
    if len({len(r) for r in ids}) != 1:
        raise ValueError("choose documents whose rows have equal lengths")
    positions = [torch.cat([torch.arange(len(d)) for d in row]) for row in per_row]
    labels = [torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in row]) for row in per_row]
    return dict(input_ids=torch.stack(ids), position_ids=torch.stack(positions), labels=torch.stack(labels),
                order=[d for row in per_row for d in row])


def loss_and_grads(model, **inputs):
    """Loss, logits and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, getattr(out, "consistency_loss", None)


def check_packed_equals_alone(model, docs: list[torch.Tensor], rows: int = 1, tol: float = 1e-5, **extra) -> None:
    """Logits, loss and gradients of the packed batch equal those of the documents each run alone, with the loss
    of the documents together the mean over all their supervised tokens (as the packed batch counts it); Maglev's
    consistency loss is the mean over all real tokens (so tests of the total loss set its weight to 0)."""
    batch = packed_batch(docs, rows)
    loss, logits, grads, consistency = loss_and_grads(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                         labels=batch["labels"], use_cache=False, **extra)
    supervised = sum(len(d) - 1 for d in docs)
    alone_loss, alone_grads, flat = 0.0, {}, logits.reshape(-1, logits.shape[-1])
    alone_consistency, tokens = 0.0, sum(len(d) for d in docs)
    column = 0
    for doc in batch["order"]:
        if len(doc) > 1:
            doc_loss, doc_logits, doc_grads, doc_consistency = loss_and_grads(model, input_ids=doc[None], labels=doc[None],
                                                             use_cache=False)
            share = (len(doc) - 1) / supervised
            alone_loss += doc_loss * share
            for name, grad in doc_grads.items():
                alone_grads[name] = alone_grads.get(name, 0) + grad * share
        else:
            with torch.no_grad():
                doc_out = model(input_ids=doc[None], use_cache=False)
            doc_logits, doc_consistency = doc_out.logits, getattr(doc_out, "consistency_loss", None)
        if consistency is not None:
            alone_consistency += doc_consistency.detach() * len(doc) / tokens
        torch.testing.assert_close(flat[column:column + len(doc)], doc_logits[0], atol=tol, rtol=tol)
        column += len(doc)
    torch.testing.assert_close(loss, torch.as_tensor(alone_loss), atol=tol, rtol=tol)
    if consistency is not None:  # the mean over all real tokens, as one padded batch of the documents has it
        torch.testing.assert_close(consistency.detach(), torch.as_tensor(alone_consistency), atol=tol, rtol=tol)
    assert grads.keys() == alone_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], alone_grads[name], atol=tol, rtol=tol, msg=name)
