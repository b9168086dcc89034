"""What a Hub folder of our architectures ships: two code files generated from the package's modules, that import
nothing but torch, transformers (and huggingface_hub and safetensors, which it installs), the standard library and each
other, that carry no speed-up code (only the seams that pick an installed package's, at the version they record), and
that load with trust_remote_code where this package is not installed and give the package model's logits exactly."""

import ast
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

import kvm_maglev
from kvm_maglev import KVMCache, KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.convert.export import build_hub_folder
from kvm_maglev.models import hub_code, hub_layout, speedups

from .without_package import expected_outputs, resave_without_package, run_script, run_without_package

# what a folder may import: the standard library, torch, and transformers with what transformers itself installs
ALLOWED = set(sys.stdlib_module_names) | {"torch", "transformers", "huggingface_hub", "safetensors"}


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "kvm":
        model = KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                         chunk_size=4, sliding_window_every=2, state_budget_mode="power_law",
                                         state_max_chunks=8))
    else:
        model = MaglevForCausalLM(MaglevConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, sliding_window=4, max_position_embeddings=64))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return model.eval()


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_two_files_importing_only_torch_transformers_and_each_other(kind):
    files = hub_code.hub_code_files(kind)
    assert sorted(files) == [f"configuration_{kind}.py", f"modeling_{kind}.py"]
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # the sibling file only
                    assert node.level == 1 and node.module == f"configuration_{kind}", (name, node.module)
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED, (name, roots)
    modeling = files[f"modeling_{kind}.py"]
    # top-down: the causal-LM class, the model, the decoder layer, attention, the cache, the state math; no section
    # of run-time pacing after it (KVM's paced fold is a speed-up, picked at its seam)
    prefix = "KVM" if kind == "kvm" else "Maglev"
    layer, math = ("KVMDecoderLayer", "class Fold:") if kind == "kvm" else ("MaglevBlock", "class StepPlan:")
    order = [f"class {prefix}ForCausalLM(", f"class {prefix}Model(", f"class {layer}(", f"class {prefix}Attention(",
             f"class {prefix}CacheLayer(", math]
    assert [modeling.index(text) for text in order] == sorted(modeling.index(text) for text in order)
    assert "# At run time" not in modeling and "class PacedFold" not in modeling
    # the model comes first: the cache's storage base is placed where the cache section needs it
    assert modeling.index(f"class {prefix}PreTrainedModel(") < modeling.index("class RowStorage:")


def test_a_base_class_is_placed_just_before_its_first_use():
    """Laid out top-down, a class would come before its base: the base is placed just before it, marked with the
    module it comes from, and its own module's section no longer holds it."""
    sections = [("# ---- base.py ----", "class Base:\n    pass\n"),
                ("# ---- model.py ----", "class Model(Base):\n    pass\n\n\nclass Other:\n    pass\n")]
    text = "\n\n\n".join(hub_layout.render(hub_layout.top_down(sections)))
    assert text == ("# ---- model.py ----\n\n\nclass Other:\n    pass\n\n\n"
                    "# (from base.py: defined here, before its first use)\nclass Base:\n    pass\n\n\n"
                    "class Model(Base):\n    pass\n\n\n# ---- base.py ----")


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_a_hub_folder_loads_without_the_package_and_gives_its_logits(kind, tmp_path):
    folder = build_hub_folder(tiny(kind), tmp_path / kind, progress=False)
    assert sorted(p.name for p in folder.glob("*.py")) == sorted(hub_code.hub_code_names(kind))
    model = (KVMForCausalLM if kind == "kvm" else MaglevForCausalLM).from_pretrained(folder).eval()  # as loaded there
    expected_outputs(model, tmp_path / "expected.pt")
    report = run_without_package(folder, tmp_path / "expected.pt", tmp_path)
    assert report["module"].startswith("transformers_modules.") and report["logits"] and report["tokens"], report


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_a_remote_code_model_saved_by_transformers_loads_again_with_its_logits(kind, tmp_path):
    """Without the package, save_pretrained of a folder's model is transformers' remote-code saving: it copies the
    two code files, and the saved folder loads with trust_remote_code to the same logits (no card is carried)."""
    folder = build_hub_folder(tiny(kind), tmp_path / kind, progress=False)
    report = resave_without_package(folder, tmp_path / "saved", tmp_path)
    assert report["module"].startswith("transformers_modules.") and report["logits"], report
    assert set(hub_code.hub_code_names(kind)) <= set(report["files"]) and "README.md" not in report["files"], report
    for name in hub_code.hub_code_names(kind):
        assert (tmp_path / "saved" / name).read_text() == (folder / name).read_text()


@torch.no_grad()
@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_a_hub_folder_models_cache_is_saved_by_the_package(kind, tmp_path):
    """Saving caches is the package's alone (the folder's files carry none of it): the cache of a model loaded with
    trust_remote_code, of the folder's own class, saves and loads back by its class name, and continues like the
    live one."""
    from transformers import AutoModelForCausalLM

    from kvm_maglev.models.common.transformers_versions import CACHE_NAME
    from kvm_maglev.package_only.saved_cache import load_cache, save_cache

    folder = build_hub_folder(tiny(kind), tmp_path / kind, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules.")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    live = getattr(model(ids[:, :6], use_cache=True), CACHE_NAME)
    save_cache(live, tmp_path / "cache")
    loaded = load_cache(tmp_path / "cache", model)
    assert type(loaded) is type(live) and loaded.get_seq_length() == live.get_seq_length() == 6
    assert torch.equal(model(ids[:, 6:], past_key_values=loaded).logits,
                       model(ids[:, 6:], past_key_values=live).logits)


def writes_or_reaches_out(text: str) -> list[str]:
    """What in a generated file would reach the network or write files: Hub downloads and uploads, safetensors or
    torch saving, `write_text` / `write_bytes`, and `open` in a writing mode."""
    found = [word for word in ("hf_hub_download", "upload", "save_file", "torch.save", "write_text", "write_bytes")
             if word in text]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "open":
            modes = [arg for arg in node.args[1:2]] + [kw.value for kw in node.keywords if kw.arg == "mode"]
            if any(not isinstance(mode, ast.Constant) or set(str(mode.value)) & set("wax+") for mode in modes):
                found.append(f"open(...) for writing, line {node.lineno}")
    return found


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_generated_files_hold_no_network_or_file_writing_code(kind):
    for name, text in hub_code.hub_code_files(kind).items():
        assert writes_or_reaches_out(text) == [], name


def test_the_check_finds_what_the_package_layer_holds():
    """The check above is not vacuous: the package layer's own modules are caught by it."""
    from kvm_maglev.package_only import carried_card, hub_save, saved_cache

    for module in (carried_card, hub_save, saved_cache):
        assert writes_or_reaches_out(open(module.__file__, encoding="utf-8").read()), module.__name__


def test_a_name_two_modules_define_is_refused(tmp_path, monkeypatch):
    """Inlined into one file, two modules' definitions of one name would collide: the generator refuses."""
    (tmp_path / "common").mkdir()
    (tmp_path / "kvm").mkdir()
    (tmp_path / "common" / "first.py").write_text('"""One."""\n\ndef shared():\n    return 1\n')
    (tmp_path / "kvm" / "second.py").write_text('"""Two."""\n\nfrom ..common.first import shared\n\n\n'
                                                  'def shared_too():\n    return shared()\n\n\ndef shared():\n    return 2\n')
    monkeypatch.setattr(hub_code, "MODELS_DIR", tmp_path)
    with pytest.raises(ValueError, match="common.first and kvm.second both define 'shared'"):
        hub_code.generate("kvm.second", {})


def test_an_import_from_above_the_models_package_is_refused(tmp_path, monkeypatch):
    """The models package is the bottom layer: a model module importing from the package above it could not run
    from a generated file, so the generator refuses it."""
    (tmp_path / "kvm").mkdir()
    (tmp_path / "kvm" / "model.py").write_text('"""Model."""\n\nfrom ...package_only.extra import Extra\n\n\n'
                                               'class Model(Extra):\n    pass\n')
    monkeypatch.setattr(hub_code, "MODELS_DIR", tmp_path)
    with pytest.raises(ValueError, match="reaches above the models package"):
        hub_code.generate("kvm.model", {})


def package_imports(path: Path) -> list[str]:
    """The modules of kvm_maglev that the module at `path` (inside the package) imports, relative or absolute."""
    root = Path(kvm_maglev.__file__).parent
    here = ["kvm_maglev", *path.relative_to(root).with_suffix("").parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - node.level]
            found += [".".join(base + ([node.module] if node.module else []))]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.append(node.args[0].value)
    return [name for name in found if name.split(".")[0] == "kvm_maglev"]


def test_the_models_package_imports_nothing_above_it():
    """Layers point one way: `kvm_maglev.models` is the bottom, and the package's layer (package_only, the
    converters, the plugin) builds on it. The root package itself is there whenever a submodule is (its version)."""
    models = Path(kvm_maglev.__file__).parent / "models"
    upward = {f"{path.relative_to(models)}: {name}" for path in models.rglob("*.py") for name in package_imports(path)
              if name != "kvm_maglev" and not name.startswith("kvm_maglev.models")}
    assert upward == set()
    assert "kvm_maglev.package_only.hub_save" in package_imports(Path(kvm_maglev.__file__).parent / "package_only"
                                                                  / "classes.py")


def speedup_code(text: str) -> list[str]:
    """What in `text` is speed-up code: a top-level definition of a name the speed-up modules (models/speedups)
    define, an import of Triton, a use of torch's oneDNN operators (`torch.ops.mkldnn`, `torch.backends.mkldnn`)."""
    defined = {node.name for path in Path(speedups.__file__).parent.glob("*.py")
               for node in ast.parse(path.read_text(encoding="utf-8")).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    tree = ast.parse(text)
    found = [f"defines {node.name}" for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in defined]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "mkldnn":
            found.append(f"uses mkldnn, line {node.lineno}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and "triton" in ast.unparse(node):
            found.append(f"imports triton, line {node.lineno}")
    return found


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_generated_files_hold_no_speedup_code(kind):
    """The files are the plain model: no oneDNN linears, no Triton kernel, no one-query attention; their seams name
    the package's speed-up modules only, and record the speed-ups' version they were written with."""
    files = hub_code.hub_code_files(kind)
    for name, text in files.items():
        assert speedup_code(text) == [], name
    assert f"CODE_VERSION: str | None = {speedups.VERSION!r}" in files[f"modeling_{kind}.py"]


def test_the_speedup_check_finds_the_speedups():
    """The check above is not vacuous: each speed-up module is caught by it."""
    for path in Path(speedups.__file__).parent.glob("*.py"):
        if path.name != "__init__.py":
            assert speedup_code(path.read_text(encoding="utf-8")), path.name


def test_a_speedup_module_is_never_inlined(tmp_path, monkeypatch):
    """A model module importing a speed-up module by name would carry it into the folder: the generator refuses."""
    (tmp_path / "kvm").mkdir()
    (tmp_path / "kvm" / "model.py").write_text('"""Model."""\n\nfrom ..speedups.fast import fast\n')
    monkeypatch.setattr(hub_code, "MODELS_DIR", tmp_path)
    with pytest.raises(ValueError, match="speedups.fast is an optional speed-up"):
        hub_code.generate("kvm.model", {})


def generated_package(kind: str, folder: Path, version: str, tag: str = "") -> object:
    """The folder's two generated files imported as a package of their own (as transformers imports remote code),
    with `version` recorded as the speed-ups' version they were written with; its modeling module (`tag` tells
    apart two packages of one version)."""
    package = folder / f"generated_{kind}_{tag}{abs(hash(version))}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in hub_code.hub_code_files(kind).items():
        (package / name).write_text(text.replace(repr(speedups.VERSION), repr(version)))
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(f"{package.name}.modeling_{kind}")
    finally:
        sys.path.remove(str(folder))


def plain_linears(model: torch.nn.Module) -> bool:
    """Whether `model` has linear layers and none is a speed-up's class (the model's own are nn.Linear and its gates'
    full-precision subclass)."""
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    return bool(linears) and not any(type(module).__module__.startswith("kvm_maglev.models.speedups")
                                     or type(module).__name__ == "OneDNNLinear" for module in linears)


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_remote_code_takes_the_installed_speedups_only_when_asked_and_at_its_version(kind, tmp_path, caplog,
                                                                                     monkeypatch):
    """Where kvm_maglev is installed, a folder's code is the plain model (nn.Linear, a speed-up block that changes
    nothing) unless its user asks for the speed-ups (KVM_MAGLEV_SPEEDUPS=1); asked, it takes them when they are the
    version it recorded (the package's oneDNN linears, its generate() switching them on); at any other version it
    warns and is the plain model. The plain model has the weights loaded and the package model's logits exactly."""
    prefix = "KVM" if kind == "kvm" else "Maglev"
    folder = build_hub_folder(tiny(kind), tmp_path / kind, progress=False)
    package_model = getattr(sys.modules[f"kvm_maglev.models.{kind}.modeling_{kind}"], f"{prefix}ForCausalLM")
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = package_model.from_pretrained(folder).eval()(ids, use_cache=False).logits

    def assert_plain(module) -> None:
        model = getattr(module, f"{prefix}ForCausalLM").from_pretrained(folder).eval()
        with torch.no_grad(), model.runtime_speedups():
            assert plain_linears(model)
            assert torch.equal(model(ids, use_cache=False).logits, expected)

    monkeypatch.delenv("KVM_MAGLEV_SPEEDUPS", raising=False)
    assert_plain(generated_package(kind, tmp_path, speedups.VERSION, tag="unasked_"))
    monkeypatch.setenv("KVM_MAGLEV_SPEEDUPS", "1")
    matching = generated_package(kind, tmp_path, speedups.VERSION)
    model = getattr(matching, f"{prefix}ForCausalLM").from_pretrained(folder).eval()
    assert type(model.lm_head) is torch.nn.Linear
    with model.runtime_speedups():
        assert type(model.lm_head) is sys.modules["kvm_maglev.models.speedups.onednn_linear"].OneDNNLinear
        assert model.lm_head.onednn
    with caplog.at_level(logging.INFO):
        other = generated_package(kind, tmp_path, "0.0.0+elsewhere")
    assert "not the 0.0.0+elsewhere this model's code was written with" in caplog.text
    assert_plain(other)


# A folder's code where the package is installed (its PYTHONPATH given): a decode stepped on the code's own cache,
# its logits and greedy tokens saved, and the module of each fold found under way (computed ahead) reported
STEPPED_SCRIPT = """
import sys, json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.load(sys.argv[2])
cache = sys.modules[type(model).__module__].KVMCache(model.config)
with torch.no_grad():
    logits, paced_by = [model(ids[:, :3], cache=cache).logits], set()
    for pos in range(3, ids.shape[1]):
        logits.append(model(ids[:, pos:pos + 1], cache=cache).logits)
        paced_by |= {type(layer.pending).__module__ for layer in cache.layers if layer.pending is not None}
    tokens = model.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
torch.save({"logits": torch.cat(logits, dim=1), "tokens": tokens}, sys.argv[3])
print(json.dumps({"module": type(model).__module__, "paced_by": sorted(paced_by)}))
"""


def stepped(model, ids: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """`STEPPED_SCRIPT`'s decode in this process: the logits and the modules of the folds found under way."""
    cache = KVMCache(model.config)
    with torch.no_grad():
        logits, paced_by = [model(ids[:, :3], cache=cache).logits], set()
        for pos in range(3, ids.shape[1]):
            logits.append(model(ids[:, pos:pos + 1], cache=cache).logits)
            paced_by |= {type(layer.pending).__module__ for layer in cache.layers if layer.pending is not None}
    return torch.cat(logits, dim=1), paced_by


def test_remote_code_paces_folds_only_when_asked_for_the_speedups(tmp_path):
    """KVM's paced fold is a speed-up (speedups/paced_fold_kvm). Where kvm_maglev is installed, a folder's code run
    without KVM_MAGLEV_SPEEDUPS folds every block at its boundary (no fold is ever under way) and still gives the
    package model's logits and greedy tokens exactly (the package paces its folds: the same tensors); asked for the
    speed-ups, it paces its folds with the package's module, to the same logits and tokens."""
    folder = build_hub_folder(tiny("kvm"), tmp_path / "kvm", progress=False)
    package = KVMForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    logits, paced_by = stepped(package, ids)
    assert paced_by == {"kvm_maglev.models.speedups.paced_fold_kvm"}  # the package paces: the check can fail
    with torch.no_grad():
        tokens = package.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
    package_path = {"PYTHONPATH": str(Path(kvm_maglev.__file__).parents[1])}
    for asked, expected in (("", []), ("1", ["kvm_maglev.models.speedups.paced_fold_kvm"])):
        out = tmp_path / f"stepped{asked}.pt"
        report = run_script(STEPPED_SCRIPT, [folder, tmp_path / "ids.pt", out], tmp_path,
                            {**package_path, "KVM_MAGLEV_SPEEDUPS": asked})
        assert report["module"].startswith("transformers_modules.") and report["paced_by"] == expected, report
        remote = torch.load(out)
        assert torch.equal(remote["logits"], logits) and torch.equal(remote["tokens"], tokens), asked


def test_a_generated_file_carries_only_what_its_model_uses():
    """Shared modules bring another model's helpers and the docs' table writer along; the generated files leave
    them out (the folders still load and give the package's logits: the tests above)."""
    kvm, maglev = hub_code.hub_code_files("kvm"), hub_code.hub_code_files("maglev")
    assert "def bucket_mask" not in kvm["modeling_kvm.py"] and "def bucket_mask" in maglev["modeling_maglev.py"]
    assert "def gather_columns" not in kvm["modeling_kvm.py"] and "def gather_columns" in maglev["modeling_maglev.py"]
    assert all("def markdown_table" not in text for files in (kvm, maglev) for text in files.values())


def test_unused_definitions_go_and_named_ones_stay():
    text = ("def used():\n    pass\n\n\n# nobody calls it\ndef unused():\n    return helper()\n\n\n"
            "def helper():\n    pass\n\n\nX = used()\n")
    assert hub_code.without_unused(text) == "def used():\n    pass\n\n\nX = used()\n"
    assert "def helper" in hub_code.without_unused(text, read_elsewhere="from .x import helper")


def test_a_section_left_without_code_loses_its_rule():
    """A module's rule stays while code or one of its own parts' rules follows; a rule with nothing under it goes."""
    rule = "# ---- {} " + "-" * 10 + "\n# its docstring\n\n\n"
    text = (rule.format("a.py") + rule.format("b.py") + "x = 1\n\n\n" + rule.format("c.py") + rule.format("part")
            + "y = 2\n\n\n" + rule.format("d.py") + rule.format("empty part"))
    assert hub_code.without_empty_sections(text) == (rule.format("b.py") + "x = 1\n\n\n" + rule.format("c.py")
                                                     + rule.format("part") + "y = 2\n\n\n")


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_a_generated_file_defines_one_logger_and_no_empty_section(kind):
    """Each package module defines its own logger; a generated file, one. Modules whose every statement is placed
    before its first use elsewhere (the mixins of generation_cache) leave no empty section behind. The modeling file carries nothing twice
    that the configuration file carries."""
    for name, text in hub_code.hub_code_files(kind).items():
        assert text.count("\nlogger = ") <= 1, name
        assert hub_code.without_empty_sections(text) == text, name
    modeling = hub_code.hub_code_files(kind)[f"modeling_{kind}.py"]
    assert "\nlogger = " in modeling and "# ---- generation_cache.py" not in modeling
    assert "class OwnCacheGenerationMixin" in modeling
    # what the configuration file carries (the version check, the cache's keyword) is imported from it, not repeated
    assert "\nCACHE_NAME = " not in modeling and "MIN_TRANSFORMERS" not in modeling
    assert "CACHE_NAME" in modeling.split("\n\n\n# ----")[0]
