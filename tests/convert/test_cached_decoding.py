"""Every folder the package writes decodes with its cache by default, whatever the training run that made the model
set: generate() feeds the prompt once, then one token per step (without the cache it re-reads the whole sequence)."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.cli import main as cli_main
from kvm_maglev.convert.export import build_hub_folder
from kvm_maglev.demo import RECALL_MODELS_DIR, build_demo_folder, save_demo_model

PROMPT, NEW = 6, 5
pytestmark = pytest.mark.usefixtures("package_auto_classes")  # package folders (no code files) load through them


def input_lengths(model) -> list[int]:
    """The input lengths of each forward of a greedy generate() from a PROMPT-token prompt."""
    lengths = []
    forward = model.forward

    def counting(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(ids.shape[1])
        return forward(*args, **kwargs)

    model.forward = counting
    ids = torch.arange(1, PROMPT + 1)[None] % model.config.vocab_size
    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return lengths


def assert_decodes_with_cache(folder, trust_remote_code=True):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code).eval()
    assert input_lengths(model) == [PROMPT] + [1] * (NEW - 1)


def trained_like(kind: str):
    """A tiny model as a training run leaves it: `use_cache` off in its config and generation config."""
    torch.manual_seed(0)
    if kind == "kvm":
        model = KVMForCausalLM(KVMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         chunk_size=4))
    else:
        model = MaglevForCausalLM(MaglevConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, sliding_window=4, max_position_embeddings=32))
    model.config.use_cache = False
    model.generation_config.use_cache = False
    return model.eval()


def test_a_training_model_still_decodes_without_its_cache_when_told():
    """The check can fail: a model whose generation config turns the cache off re-reads the sequence."""
    model = trained_like("kvm")
    assert input_lengths(model) == list(range(PROMPT, PROMPT + NEW))


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_save_pretrained_writes_a_cached_decoding_folder(kind, tmp_path):
    """finetune.py's output (Trainer.save_model) and train_recall.py --save-models (save_demo_model)."""
    model = trained_like(kind)
    model.save_pretrained(tmp_path / "saved")
    assert model.config.use_cache is False  # the model in memory keeps its setting
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] is True
    assert_decodes_with_cache(tmp_path / "saved", trust_remote_code=False)
    save_demo_model(model, tmp_path / "kept", {"task": "test"})
    assert_decodes_with_cache(tmp_path / "kept", trust_remote_code=False)


@pytest.mark.parametrize("kind", ["kvm", "maglev"])
def test_hub_folders_decode_with_their_cache(kind, tmp_path):
    """build_hub_folder from a model (converter) and from a kept folder saved with use_cache off and no generation
    config, as earlier versions kept them (demo, push)."""
    model = trained_like(kind)
    assert_decodes_with_cache(build_hub_folder(model, tmp_path / "from_model", progress=False))
    kept = tmp_path / "kept"
    model.save_pretrained(kept)
    config = json.loads((kept / "config.json").read_text())
    (kept / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    (kept / "generation_config.json").unlink()
    built = build_hub_folder(kept, tmp_path / "from_folder", progress=False)
    assert json.loads((built / "generation_config.json").read_text())["use_cache"] is True
    assert_decodes_with_cache(built)


@pytest.mark.parametrize("name", sorted(path.name for path in RECALL_MODELS_DIR.iterdir() if path.is_dir()))
def test_demo_folders_decode_with_their_cache(name, tmp_path):
    assert_decodes_with_cache(build_demo_folder(RECALL_MODELS_DIR / name, tmp_path))


def test_converted_research_checkpoint_decodes_with_its_cache(tmp_path, data_dir):
    source = tmp_path / "research_final"
    shutil.copytree(data_dir / "kvm" / "kvm_fixed" / "research_final", source)
    assert cli_main(["convert", "kvm", str(source), str(tmp_path / "out")]) == 0
    assert_decodes_with_cache(tmp_path / "out")
