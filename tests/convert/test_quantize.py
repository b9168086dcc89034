"""`kvm-maglev quantize`: compressed-tensors W8A8 / W4A16 folders of both models (issue 56 item 3). A folder reloads
with transformers' `from_pretrained`, its weights equal a quantize-dequantize written here from the schemes'
definitions (symmetric, per output channel / per group of input columns), its logits equal the float model's with
those weights and, for W8A8, its activations quantized per token; the kept layers (gates, head) are the float ones
exactly. Written whole or not at all; bad inputs end in one error line."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from kvm_maglev.cli import main
from tests.models.test_quantization import KEPT, ids, tiny

pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
              pytest.mark.usefixtures("package_auto_classes")]

GROUP = 32  # the W4A16 group size of these tests (hidden 128)
QMAX = {"W8A8": 127, "W4A16": 7}  # symmetric int8 / int4: [-QMAX - 1, QMAX]


def fake_quantized(x: torch.Tensor, bits_max: int, group: int | None) -> torch.Tensor:
    """`x` rounded to symmetric integers and back, one scale per row (or per `group` columns of a row): the
    largest magnitude maps to QMAX + 1/2, as compressed-tensors' min-max scale does."""
    rows = x if group is None else x.reshape(*x.shape[:-1], -1, group)
    scale = rows.abs().amax(dim=-1, keepdim=True) / (bits_max + 0.5)
    return ((rows / scale).round().clamp(-bits_max - 1, bits_max) * scale).reshape(x.shape)


def reference(model: nn.Module, scheme: str, quantized: set[str]) -> nn.Module:
    """The float `model` with the quantized layers' weights quantized and dequantized here, and for W8A8 their
    inputs quantized per token (dynamic activations)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name not in quantized:
                continue
            module.weight.copy_(fake_quantized(module.weight, QMAX[scheme], GROUP if scheme == "W4A16" else None))
            if scheme == "W8A8":
                module.register_forward_pre_hook(lambda _, args: (fake_quantized(args[0], 127, None),))
    return model


def load(folder) -> nn.Module:
    """A quantized folder loaded by model_type through the Auto classes (registered for this module only)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module", params=["kvm", "maglev"])
def float_folder(request, tmp_path_factory):
    """(kind, a package-saved float folder)."""
    folder = tmp_path_factory.mktemp(f"float_{request.param}")
    tiny(request.param).save_pretrained(folder)
    return request.param, folder


def projections(kind: str, model: nn.Module) -> set[str]:
    """Every linear layer but the head and the declared kept ones."""
    return {name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and name != "lm_head" and name.rsplit(".", 1)[-1] not in KEPT[kind]}


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_a_quantized_folder_reloads_to_the_reference_quantization(float_folder, scheme, tmp_path):
    kind, folder = float_folder
    out = tmp_path / "quantized"
    assert main(["quantize", str(folder), "--scheme", scheme, "--out", str(out), "--group-size", str(GROUP)]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == ("int-quantized" if scheme == "W8A8" else "pack-quantized")
    float_model = tiny(kind)
    quantized = projections(kind, float_model)
    kept = {name for name, module in float_model.named_modules() if isinstance(module, nn.Linear)} - quantized
    assert set(config["ignore"]) == kept and "lm_head" in kept

    model, x = load(out), ids()
    with torch.no_grad():
        logits = model(x).logits  # the first forward decompresses the weights
    weights = dict(model.named_parameters())
    for name, param in float_model.named_parameters():
        if name.rsplit(".", 1)[0] not in quantized:  # kept layers, embeddings, norms: the float ones exactly
            torch.testing.assert_close(weights[name], param, rtol=0, atol=0, msg=name)
    for name in quantized:
        assert getattr(model.get_submodule(name), "quantization_scheme", None) is not None, name
    with torch.no_grad():
        expected = reference(float_model, scheme, quantized)(x).logits
        plain = tiny(kind)(x).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    # and close to the float model: int8 within 5% of the largest logit, int4 within 30%
    assert (logits - plain).abs().max() <= (0.05 if scheme == "W8A8" else 0.3) * plain.abs().max()


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_a_quantized_folder_generates_with_its_cache_as_without(float_folder, scheme, tmp_path):
    """Cached decoding of the quantized model equals greedy decoding by full forwards (W8A8's activation scales
    are per token, so a decoding step's row is quantized as in the full forward)."""
    kind, folder = float_folder
    from kvm_maglev.convert.quantize import quantize_folder

    model = load(quantize_folder(folder, scheme, tmp_path / "q", group_size=GROUP))
    prompt = ids(rows=1, length=6)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
        tokens = prompt
        for _ in range(6):
            next_token = model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=-1)
    assert torch.equal(generated, tokens)


def test_skip_adds_to_the_kept_layers(float_folder, tmp_path):
    kind, folder = float_folder
    out = tmp_path / "q"
    assert main(["quantize", str(folder), "--scheme", "W8A8", "--out", str(out), "--skip", "down_proj"]) == 0
    ignore = set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    assert "lm_head" in ignore and {name.rsplit(".", 1)[-1] for name in ignore} >= KEPT[kind] | {"down_proj"}
    model = load(out)
    assert getattr(model.model.layers[0].mlp.down_proj, "quantization_scheme", None) is None
    assert getattr(model.model.layers[0].mlp.up_proj, "quantization_scheme", None) is not None


def test_bad_inputs_end_in_one_error_line_and_nothing_written(float_folder, tmp_path, capsys):
    kind, folder = float_folder
    out = tmp_path / "q"
    cases = [
        (["--scheme", "W4A16", "--group-size", "48"], "group size 48 does not divide"),
        (["--scheme", "W8A8", "--skip", "q_proj", "--skip", "k_proj", "--skip", "v_proj", "--skip", "o_proj",
          "--skip", "up_proj", "--skip", "down_proj", "--skip", "value_gate_down", "--skip", "memory_k_proj",
          "--skip", "memory_v_proj"], "no linear layer left to quantize"),
    ]
    for flags, message in cases:
        assert main(["quantize", str(folder), "--out", str(out), *flags]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
    assert main(["quantize", str(tmp_path / "missing"), "--scheme", "W8A8", "--out", str(out)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["quantize", str(folder), "--scheme", "W8A8", "--out", str(out)]) == 0
    assert main(["quantize", str(out), "--scheme", "W8A8", "--out", str(tmp_path / "again")]) == 2
    assert "already quantized (compressed-tensors)" in capsys.readouterr().err
    assert main(["quantize", str(folder), "--scheme", "W8A8", "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["q"]  # no temporary folder left behind


def test_a_failed_write_leaves_nothing(float_folder, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from kvm_maglev.convert.quantize import quantize_folder

    kind, folder = float_folder

    def fail(self, *args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        quantize_folder(folder, "W8A8", tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


HUB_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
with torch.no_grad():
    logits = model(ids).logits
quantized = sorted(name for name, module in model.named_modules()
                   if getattr(module, "quantization_scheme", None) is not None)
print(json.dumps({"module": type(model).__module__, "quantized": quantized, "logits": logits[0].tolist()}))
"""


def test_a_hub_folder_quantizes_and_loads_without_the_package(float_folder, tmp_path):
    """A generated Hub folder (its own code) quantizes; the result loads with that code where the package is absent,
    to the logits the package's load of it gives."""
    from kvm_maglev.convert.export import build_hub_folder
    from kvm_maglev.convert.quantize import quantize_folder
    from tests.convert.without_package import run_script

    kind, _ = float_folder
    float_model = tiny(kind)
    hub = build_hub_folder(float_model, tmp_path / "hub", progress=False)
    out = quantize_folder(hub, "W4A16", tmp_path / "q", group_size=GROUP)
    assert sorted(p.name for p in out.glob("*.py")) == sorted(p.name for p in hub.glob("*.py"))
    report = run_script(HUB_SCRIPT, [out], tmp_path)
    assert not report["module"].startswith("kvm_maglev")
    assert set(report["quantized"]) == projections(kind, float_model)
    with torch.no_grad():
        expected = load(out)(torch.tensor([[5, 17, 33, 2, 90, 41]])).logits[0]
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, rtol=0, atol=1e-4)


UNREGISTERED_LOAD = """
import sys
from pathlib import Path
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from kvm_maglev.convert.quantize import load_float_model
model = load_float_model(Path(sys.argv[1]))
print(type(model).__name__, sorted(name for name in ("kvm", "maglev") if name in CONFIG_MAPPING))
"""


def test_loading_the_float_model_registers_no_auto_class(float_folder):
    """The quantizer loads the package's folders by model_type without registering the Auto classes: a registration
    lasts for the process and would make every remote-code folder loaded after it use the package's code."""
    import subprocess
    import sys

    kind, folder = float_folder
    result = subprocess.run([sys.executable, "-c", UNREGISTERED_LOAD, str(folder)], capture_output=True, text=True,
                            timeout=180, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"{type(tiny(kind)).__name__} []"
