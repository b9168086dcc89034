"""torch.compile against eager generation on both models: `torch.compile(model)` and a compiled `forward`
(what generate() then calls each step) give greedy's tokens. Compilation is slow on CPU: few small cases."""

from __future__ import annotations

import pytest
import torch

from tests.generation.testers import PAD, TESTERS


@torch.no_grad()
@pytest.mark.parametrize("how", ["model", "forward"])
@pytest.mark.parametrize("name", sorted(TESTERS))
def test_compiled_generation_equals_eager(name, how):
    tester = TESTERS[name]
    model = tester.build(0, **tester.variants[next(iter(tester.variants))])
    prompt = tester.random_ids(1, 10, seed=5)
    kwargs = dict(max_new_tokens=3 * tester.block, do_sample=False, pad_token_id=PAD)  # crosses block boundaries
    eager = model.generate(prompt, **kwargs)
    torch._dynamo.reset()
    if how == "model":
        compiled = torch.compile(model)
        assert torch.equal(compiled.generate(prompt, **kwargs), eager)
        cache = tester.cache_class(model.config)
        steps = [compiled(eager[:, :10], past_key_values=cache).logits[:, -1]]
        steps += [compiled(eager[:, i:i + 1], past_key_values=cache).logits[:, -1] for i in range(10, eager.shape[1] - 1)]
        assert torch.equal(torch.cat(steps).argmax(-1), eager[0, 10:])
    else:
        eager_forward = model.forward
        model.forward = torch.compile(model.forward)
        try:
            assert torch.equal(model.generate(prompt, **kwargs), eager)
        finally:
            model.forward = eager_forward
