"""KVM parity with the research code on the fixtures, converted from both checkpoint forms.

Targets: `logits_full_fp32rope` (full forward) and `decode_logits_fp32rope` (prefill, then one
token per step) within 1e-4 in float32, and the research `state_len` per layer per step.
The error against the research code as it runs (bf16-rounded rotary tables and state
values) is printed, not asserted.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kvm_maglev.convert.kvm import convert
from kvm_maglev.models.common.transformers_versions import returned_cache
from kvm_maglev.models.kvm import KVMForCausalLM

CASES = ("kvm_fixed", "kvm_sqrt", "kvm_saturate_swa")
FORMS = ("research_pt", "research_final")
TOLERANCE = 1e-4



@pytest.fixture(scope="module")
def converted(data_dir, tmp_path_factory):
    """Converted folder per (case, form), built once."""
    folders = {}

    def get(case: str, form: str):
        if (case, form) not in folders:
            case_dir = data_dir / "kvm" / case
            out = tmp_path_factory.mktemp(f"{case}_{form}") / "model"
            if form == "research_pt":
                # trained by recursal/KVM-paper 1932b9c, which the YAML does not say (kvm_sqrt's state appends)
                convert(case_dir / "research" / "model_step000050.pt", out, config_path=case_dir / "research" / "config.yaml",
                        research_commit="1932b9c")
            else:
                convert(case_dir / "research_final", out)
            folders[case, form] = out
        return folders[case, form]

    return get


def full_and_cached_run(model, reference: dict):
    """The reference's full forward, and its prefill then one-token decode on a cache (with state lengths)."""
    input_ids, prefill = reference["input_ids"], int(reference["prefill_len"])
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits
        out = model(input_ids[:, :prefill], use_cache=True)
        cache = returned_cache(out)
        state_len, decoded = [cache.state_lengths()], []
        for pos in range(prefill, input_ids.shape[1]):
            decoded.append(model(input_ids[:, pos : pos + 1], cache=cache).logits)
            state_len.append(cache.state_lengths())
    return full, out, torch.cat(decoded, dim=1), state_len


def assert_matches_reference(model, reference: dict, label: str) -> None:
    """Full forward and cached decode equal the reference's float32-rotary logits, with the same state lengths;
    the errors against the research code as run (bf16 roundings) are printed for the record."""
    full, out, decoded, state_len = full_and_cached_run(model, reference)
    errors = {name: (ours - reference[key]).abs().max().item() for name, ours, key in (
        ("full", full, "logits_full_fp32rope"), ("decode", decoded, "decode_logits_fp32rope"),
        ("full as run", full, "logits_full"), ("decode as run", decoded, "decode_logits"))}
    print(f"\n[{label}] max abs error: " + ", ".join(f"{name} {error:.2e}" for name, error in errors.items()))
    assert errors["full"] <= TOLERANCE
    assert errors["decode"] <= TOLERANCE
    assert torch.equal(torch.tensor(state_len), reference["state_len"])
    # the cached prefill logits are the full forward's
    assert torch.allclose(out.logits, full[:, : out.logits.shape[1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES)
def test_parity_with_research(case, form, converted, data_dir):
    reference = load_file(str(data_dir / "kvm" / case / "reference.safetensors"))
    model = KVMForCausalLM.from_pretrained(converted(case, form), dtype=torch.float32).eval()
    assert_matches_reference(model, reference, f"{case}/{form}")


def test_both_forms_give_the_same_weights(converted):
    from safetensors.torch import load_file as load

    for case in CASES:
        pt = load(str(converted(case, "research_pt") / "model.safetensors"))
        final = load(str(converted(case, "research_final") / "model.safetensors"))
        assert pt.keys() == final.keys()
        assert all(torch.equal(pt[k].float(), final[k].float()) for k in pt)
