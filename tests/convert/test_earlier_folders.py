"""Hub folders written by earlier versions of the package (16 code files and a tokenizer module, before a folder's
code became two generated files) keep loading: with their own code where the package is not installed, and with the
package, which gives the same tokens and logits up to float rounding (the batched attention sums in another
order; Maglev's decoding step reads its written ring and the key the token displaced, the keys in another order
than those versions' ring and token: 1.3e-5 apart here)."""

import pytest

from kvm_maglev import KVMForCausalLM, MaglevForCausalLM

from .without_package import expected_outputs, run_without_package


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_a_folder_of_an_earlier_version_loads_and_agrees_with_the_package(kind, data_dir, tmp_path):
    folder = data_dir / "earlier_hub_folders" / kind
    assert len(list(folder.glob("*.py"))) == 16  # the old layout, as that version wrote it (no tokenizer module)
    model = (KVMForCausalLM if kind == "kvm" else MaglevForCausalLM).from_pretrained(folder).eval()
    expected_outputs(model, tmp_path / "expected.pt")
    report = run_without_package(folder, tmp_path / "expected.pt", tmp_path)
    assert report["module"].startswith("transformers_modules.") and report["tokens"], report
    assert report["logits_max_difference"] <= 5e-5, report
