"""`kvm-maglev convert {kvm,maglev} SRC OUT` end to end through the command-line entry point.

Every fixture case (KVM: three cases, trainer .pt + YAML and final folder; nanochat: both steps)
converts to a folder whose weights, tokenizer, generation config and card load with plain
transformers / huggingface_hub in one process where kvm_maglev cannot be imported. bf16 and
sharded outputs hold the same weights; each bad input ends in one error line, exit code 2,
no traceback and nothing at OUT.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from kvm_maglev.cli import main
from kvm_maglev.convert.cards import file_sha256
from kvm_maglev.hub import find_source_checkpoint
from kvm_maglev.tokenization.gpt2 import load_research_tokenizer
from kvm_maglev.tokenization.nanochat import load_nanochat_tokenizer

KVM_CASES = ("kvm_fixed", "kvm_sqrt", "kvm_saturate_swa")
MAGLEV_STEPS = (10, 11)
PROMPT_TOKENS = 48
TOLERANCE = 1e-4
BF16_TOLERANCE = 0.25  # bf16 weights and activations against float32 reference logits
TEXT = "The key to long context is <|bos|> memory, 12345 and  spaces\n\tend"



def convert(*argv: str) -> int:
    return main(["convert", *map(str, argv)])


def kvm_pt_args(case_dir: Path) -> list:
    research = case_dir / "research"
    # the fixtures in tests/data/kvm were trained by recursal/KVM-paper 1932b9c, which their YAML does not say
    return [research / "model_step000050.pt", "--config", research / "config.yaml",
            "--tokenizer", case_dir / "research_final", "--research-commit", "1932b9c"]


@pytest.fixture(scope="module")
def folders(data_dir, tmp_path_factory) -> dict[str, dict]:
    """Every fixture case converted once: name -> {path, architecture, reference, ...}."""
    root = tmp_path_factory.mktemp("converted")
    made = {}
    for case in KVM_CASES:
        case_dir = data_dir / "kvm" / case
        reference = str(case_dir / "reference.safetensors")
        out = root / f"{case}_final"
        assert convert("kvm", case_dir / "research_final", out, "--license", "apache-2.0") == 0
        made[out.name] = dict(path=str(out), architecture="kvm", reference=reference, logits_key="logits_full_fp32rope",
                              source=case_dir / "research_final" / "model.safetensors", step=None)
        out = root / f"{case}_pt"
        assert convert("kvm", *kvm_pt_args(case_dir)[:1], out, *kvm_pt_args(case_dir)[1:]) == 0
        made[out.name] = dict(path=str(out), architecture="kvm", reference=reference, logits_key="logits_full_fp32rope",
                              source=case_dir / "research" / "model_step000050.pt", step=50)
    nanochat = data_dir / "nanochat" / "tiny_sl"
    for step in MAGLEV_STEPS:
        out = root / f"maglev_step{step}"
        assert convert("maglev", nanochat / "base_checkpoints" / "d2", out, "--step", step,
                       "--datasets", "karpathy/fineweb-edu-100b-shuffle") == 0
        made[out.name] = dict(path=str(out), architecture="maglev", reference=str(nanochat / "reference.safetensors"),
                              logits_key="logits_full", step=step,
                              source=nanochat / "base_checkpoints" / "d2" / f"model_{step:06d}.pt")
    # bf16 and sharded outputs; the package-free process dumps the state dicts it loads from them
    final = data_dir / "kvm" / "kvm_saturate_swa" / "research_final"
    out = root / "kvm_saturate_swa_bf16"
    assert convert("kvm", final, out, "--dtype", "bfloat16") == 0
    made[out.name] = dict(made["kvm_saturate_swa_final"], path=str(out), dtype="bfloat16",
                          dump=str(root / "loaded_bf16.safetensors"))
    out = root / "maglev_step10_sharded"
    assert convert("maglev", nanochat / "base_checkpoints" / "d2", out, "--step", "10", "--max-shard-size", "300KB",
                   "--datasets", "karpathy/fineweb-edu-100b-shuffle") == 0
    made[out.name] = dict(made["maglev_step10"], path=str(out), dump=str(root / "loaded_sharded.safetensors"))
    return made


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    tensors = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(folder / shard))
    return tensors


def test_folders_are_complete_hub_repositories(folders):
    for name, info in folders.items():
        folder = Path(info["path"])
        names = {p.name for p in folder.iterdir()}
        arch = info["architecture"]
        weights = "model.safetensors.index.json" if "sharded" in name else "model.safetensors"
        expected = {"config.json", weights, "generation_config.json", "README.md", "tokenizer.json",
                    "tokenizer_config.json", f"configuration_{arch}.py", f"modeling_{arch}.py"}
        assert expected <= names, (name, expected - names)
        assert not [n for n in os.listdir(folder.parent) if n.startswith(".")], "temporary folder left behind"
        card = (folder / "README.md").read_text()
        assert file_sha256(info["source"]) in card and f"- source: `{Path(info['source']).name}`" in card
        assert str(Path(info["source"]).parent) not in card and f'repo = "{folder}"' in card  # no path but OUT
        assert (f"training step: {info['step']}" in card) == (info["step"] is not None)
        assert "**Parameters:**" in card and "| 1M |" in card and "| 128k |" in card
        assert "Needs `transformers>=5.17`" in card
        assert find_source_checkpoint(folder) == Path(info["source"]).name  # --push-to-hub's commit message names it
    kvm_tokenizer_config = json.loads((Path(folders["kvm_fixed_pt"]["path"]) / "tokenizer_config.json").read_text())
    assert "tokenizer_class" in kvm_tokenizer_config and "auto_map" not in kvm_tokenizer_config
    assert (Path(folders["maglev_step10"]["path"]) / "tokenization_nanochat.py").is_file()


# Runs where kvm_maglev cannot be imported: everything below is plain transformers / huggingface_hub.
LOADER = r"""
import importlib.abc, io, json, sys, contextlib
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvm_maglev" or name.startswith("kvm_maglev."):
            raise ImportError("kvm_maglev is blocked in this process")
sys.meta_path.insert(0, Block())
try:
    import kvm_maglev
    raise SystemExit("kvm_maglev was importable")
except ImportError:
    pass
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
torch.set_num_threads(1)
folders, text, prompt_tokens = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
report = {}
for name, info in folders.items():
    folder, entry = info["path"], {}
    if info["architecture"] == "kvm":
        # no remote code for the tokenizer: trust_remote_code=False never prompts and must work
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        entry["prompted"] = "custom code" in printed.getvalue()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # transformers 5 asks about config.json's code; stdin is closed
            entry["plain_ids"] = AutoTokenizer.from_pretrained(folder).encode(text)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        entry["chat_ids"] = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], return_dict=False)
    entry["tokenizer_class"] = type(tokenizer).__name__
    entry["ids"] = tokenizer.encode(text)
    generation = GenerationConfig.from_pretrained(folder)
    entry["generation"] = {k: getattr(generation, k, None)
                           for k in ("bos_token_id", "eos_token_id", "pad_token_id", "suppress_tokens")}
    card = ModelCard.load(folder + "/README.md", ignore_metadata_errors=False)
    entry["card"] = {"library_name": card.data.library_name, "pipeline_tag": card.data.pipeline_tag,
                     "tags": card.data.tags, "license": card.data.license, "datasets": card.data.datasets}
    dtype = getattr(torch, info.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype).eval()
    assert "kvm_maglev" not in type(model).__module__
    if "dump" in info:
        save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, info["dump"])
    reference = load_file(info["reference"])
    ids = reference["input_ids"][:, :prompt_tokens]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
    expected = reference[info["logits_key"]][:, :prompt_tokens]
    entry["logits_error"] = (logits[..., :expected.shape[-1]] - expected).abs().max().item()
    report[name] = entry
print(json.dumps(report))
"""


def run_without_package(folders: dict, tmp_path: Path) -> dict:
    payload = json.dumps({name: {k: str(v) for k, v in info.items()} for name, info in folders.items()})
    result = subprocess.run(
        [sys.executable, "-c", LOADER, payload, TEXT, str(PROMPT_TOKENS)], capture_output=True, text=True,
        cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
             "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def loaded(folders, tmp_path_factory) -> dict:
    """What the package-free process read from every folder."""
    return run_without_package(folders, tmp_path_factory.mktemp("package_free"))


def test_every_case_loads_without_the_package(folders, loaded, data_dir):
    report = loaded
    gpt2 = load_research_tokenizer(data_dir / "kvm" / "kvm_fixed" / "research_final")
    nanochat = load_nanochat_tokenizer(data_dir / "nanochat" / "tiny_sl" / "tokenizer")
    for name, info in folders.items():
        entry = report[name]
        bound = TOLERANCE if info.get("dtype", "float32") == "float32" else BF16_TOLERANCE
        assert entry["logits_error"] <= bound, (name, entry["logits_error"])
        card = entry["card"]
        assert card["library_name"] == "transformers" and card["pipeline_tag"] == "text-generation", name
        assert {"custom_code", info["architecture"]} <= set(card["tags"]), name
        generation = entry["generation"]
        if info["architecture"] == "kvm":
            assert not entry["prompted"], name
            assert entry["ids"] == entry["plain_ids"] == gpt2.encode(TEXT), name
            assert entry["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast"), name
            eos = gpt2.eos_token_id
            assert generation["bos_token_id"] == generation["eos_token_id"] == generation["pad_token_id"] == eos
            vocab = json.loads((Path(info["path"]) / "config.json").read_text())["vocab_size"]
            assert generation["suppress_tokens"] == list(range(len(gpt2), vocab)) and len(gpt2) < vocab
            assert card["license"] == ("apache-2.0" if name.endswith("_final") else None), name
        else:
            assert entry["tokenizer_class"] == "NanochatTokenizerFast"
            assert entry["ids"] == nanochat.encode(TEXT), name
            assert entry["chat_ids"] == nanochat.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], return_dict=False)
            bos, end = nanochat.convert_tokens_to_ids(["<|bos|>", "<|assistant_end|>"])
            assert generation["bos_token_id"] == bos and generation["eos_token_id"] == [end, bos]
            assert generation["pad_token_id"] == end and not generation["suppress_tokens"]
            assert card["datasets"] == ["karpathy/fineweb-edu-100b-shuffle"]


def test_bfloat16_and_sharded_outputs_hold_the_same_weights(folders, loaded):
    bf16, float32 = (Path(folders[name]["path"]) for name in ("kvm_saturate_swa_bf16", "kvm_saturate_swa_final"))
    stored, reference = _weights(bf16), _weights(float32)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16} and stored.keys() == reference.keys()
    assert all(torch.equal(stored[k], reference[k].bfloat16()) for k in stored)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert "dtype=torch.bfloat16" in (bf16 / "README.md").read_text()

    sharded, single = (Path(folders[name]["path"]) for name in ("maglev_step10_sharded", "maglev_step10"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    resharded, whole = _weights(sharded), _weights(single)
    assert resharded.keys() == whole.keys() and all(torch.equal(resharded[k], whole[k]) for k in whole)

    # what plain transformers loaded from them (in the package-free process)
    for name, expected in (("kvm_saturate_swa_bf16", stored), ("maglev_step10_sharded", whole)):
        state = load_file(folders[name]["dump"])
        assert all(torch.equal(state[k], expected[k]) for k in expected), name


def test_default_dtype_is_the_source_dtype(data_dir, tmp_path):
    """A bf16 final folder stays bf16 unless --dtype says otherwise."""
    source = tmp_path / "bf16_final"
    shutil.copytree(data_dir / "kvm" / "kvm_fixed" / "research_final", source)
    state = load_file(source / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in state.items()}, source / "model.safetensors")
    assert convert("kvm", source, tmp_path / "out") == 0
    assert {t.dtype for t in _weights(tmp_path / "out").values()} == {torch.bfloat16}
    assert convert("kvm", source, tmp_path / "out32", "--dtype", "float32") == 0
    assert {t.dtype for t in _weights(tmp_path / "out32").values()} == {torch.float32}


def test_dry_run_writes_nothing(data_dir, tmp_path, capsys):
    out = tmp_path / "nested" / "out"
    assert convert("kvm", *kvm_pt_args(data_dir / "kvm" / "kvm_sqrt")[:1], out,
                   *kvm_pt_args(data_dir / "kvm" / "kvm_sqrt")[1:], "--dry-run", "--max-shard-size", "100KB",
                   "--push-to-hub", "org/name") == 0
    printed = capsys.readouterr().out
    assert "would write" in printed and "README.md" in printed and "index.json" in printed
    assert "would push" in printed
    assert list(tmp_path.iterdir()) == []


def test_progress_shows_every_stage(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # the plain-lines display
    assert convert("maglev", data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2", tmp_path / "out") == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert lines[0] == "[1/10] read checkpoint" and lines[2] == "[3/10] tokenizer"
    assert lines[-1] == "[10/10] move into place" and len(lines) == 10


# ----- bad inputs: one message, exit code != 0, no traceback, nothing at OUT ----------------------------------
def fails_cleanly(capsys, out: Path, *argv) -> str:
    assert convert(*argv) != 0
    err = capsys.readouterr().err
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in err, err
    assert not out.exists(), "OUT was left behind"
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "temporary folder left"
    return err


def test_truncated_checkpoints(data_dir, tmp_path, capsys):
    case_dir = data_dir / "kvm" / "kvm_fixed"
    truncated = tmp_path / "model_step000050.pt"
    data = (case_dir / "research" / "model_step000050.pt").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", truncated, tmp_path / "out", "--config",
                        case_dir / "research" / "config.yaml", "--tokenizer", case_dir / "research_final")
    assert "truncated or corrupted" in err and str(truncated) in err

    nanochat = tmp_path / "base_checkpoints" / "d2"
    shutil.copytree(data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2", nanochat)
    data = (nanochat / "model_000011.pt").read_bytes()
    (nanochat / "model_000011.pt").write_bytes(data[:-100])
    err = fails_cleanly(capsys, tmp_path / "out", "maglev", nanochat, tmp_path / "out",
                        "--tokenizer", data_dir / "nanochat" / "tiny_sl" / "tokenizer")
    assert "truncated or corrupted" in err and "model_000011.pt" in err


def test_corrupted_safetensors(data_dir, tmp_path, capsys):
    source = tmp_path / "final"
    shutil.copytree(data_dir / "kvm" / "kvm_fixed" / "research_final", source)
    data = bytearray((source / "model.safetensors").read_bytes())
    data[60:90] = b"\x00" * 30  # inside the JSON header
    (source / "model.safetensors").write_bytes(bytes(data))
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", source, tmp_path / "out")
    assert "truncated or corrupted" in err and "safetensors" in err


class _RunsCode:
    """Pickles as a call to os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_pickle_with_code_is_refused(data_dir, tmp_path, capsys):
    case_dir = data_dir / "kvm" / "kvm_fixed"
    checkpoint = torch.load(case_dir / "research" / "model_step000050.pt", weights_only=True)
    marker = tmp_path / "code_ran"
    checkpoint["optimizers"] = [_RunsCode(marker)]
    evil = tmp_path / "model_step000050.pt"
    torch.save(checkpoint, evil)
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", evil, tmp_path / "out", "--config",
                        case_dir / "research" / "config.yaml", "--tokenizer", case_dir / "research_final")
    assert "pickled objects other than tensors" in err and "system" in err
    assert not marker.exists()


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", 128, ["wrongly shaped", "model.embed_tokens.weight: expected [512, 128], got [512, 64]"]),
    ("num_hidden_layers", 3, ["missing: model.layers.2."]),
    ("num_hidden_layers", 1, ["unexpected: model.layers.1."]),
])
def test_yaml_that_does_not_match_the_weights(data_dir, tmp_path, capsys, field, value, expected):
    case_dir = data_dir / "kvm" / "kvm_fixed"
    document = yaml.safe_load((case_dir / "research" / "config.yaml").read_text())
    document["model"][field] = value
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document))
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", case_dir / "research" / "model_step000050.pt",
                        tmp_path / "out", "--config", config, "--tokenizer", case_dir / "research_final")
    assert "do not fit the config" in err and str(config) in err
    assert all(text in err for text in expected), err


@pytest.mark.parametrize("field", ["n_embd", "n_layer"])
def test_meta_that_does_not_match_the_weights(data_dir, tmp_path, capsys, field):
    nanochat = tmp_path / "base_checkpoints" / "d2"
    shutil.copytree(data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2", nanochat)
    meta = json.loads((nanochat / "meta_000010.json").read_text())
    model_config = meta["model_config"]
    if field == "n_embd":  # half the width: every matrix is misshapen
        rows, width = torch.load(nanochat / "model_000010.pt", weights_only=True)["transformer.wte.weight"].shape
        model_config["n_embd"] = width // 2
        expected = ["wrongly shaped",
                    f"model.embed_tokens.weight: expected [{rows}, {width // 2}], got [{rows}, {width}]"]
    else:  # one layer too many: its weights are missing
        model_config["n_layer"] += 1
        expected = ["missing: ", f"model.layers.{model_config['n_layer'] - 1}.mlp.up_proj.weight"]
    (nanochat / "meta_000010.json").write_text(json.dumps(meta))
    err = fails_cleanly(capsys, tmp_path / "out", "maglev", nanochat, tmp_path / "out", "--step", "10",
                        "--tokenizer", data_dir / "nanochat" / "tiny_sl" / "tokenizer")
    assert "do not fit meta_000010.json" in err and all(text in err for text in expected), err


def test_missing_sources(data_dir, tmp_path, capsys):
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", tmp_path / "nowhere", tmp_path / "out")
    assert "nowhere" in err and "does not exist" in err
    err = fails_cleanly(capsys, tmp_path / "out", "maglev", tmp_path / "nowhere", tmp_path / "out")
    assert "nowhere" in err and "does not exist" in err
    case_dir = data_dir / "kvm" / "kvm_fixed"
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", case_dir / "research" / "model_step000050.pt",
                        tmp_path / "out", "--config", case_dir / "research" / "config.yaml")
    assert "--tokenizer" in err
    err = fails_cleanly(capsys, tmp_path / "out", "maglev", data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2",
                        tmp_path / "out", "--tokenizer", tmp_path / "no_tokenizer")
    assert "no_tokenizer" in err


def test_existing_out_needs_overwrite(data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    source = data_dir / "kvm" / "kvm_fixed" / "research_final"
    assert convert("kvm", source, out) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    assert convert("kvm", source, out, "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_push_to_hub_after_converting(data_dir, tmp_path):
    """`--push-to-hub ORG/NAME --private --push-revision dev` publishes OUT (to the local Hub test double)."""
    from tests.hub.hub_server import HubServer

    source = data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2"
    out = tmp_path / "out"
    with HubServer() as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_TOKEN=hub.token, HF_HUB_DISABLE_XET="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
        result = subprocess.run(
            [sys.executable, "-m", "kvm_maglev", "convert", "maglev", str(source), str(out),
             "--push-to-hub", "test-user/maglev-tiny", "--private", "--push-revision", "dev"],
            env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        repo = hub.repo("test-user/maglev-tiny")
        dev = repo.resolve("dev")
    assert repo.private and "pushed to test-user/maglev-tiny@dev" in result.stdout
    assert dev.title.endswith("converted from model_000011.pt")
    assert {p.name for p in out.iterdir()} <= set(dev.files)
    assert hub.token not in result.stdout + result.stderr


def test_sizes_and_bad_flags_are_refused_while_parsing(data_dir, tmp_path, capsys):
    from kvm_maglev.convert.common import parse_size

    assert [parse_size(s) for s in ("2GB", "500MiB", "1.5kb", "4096", 7)] == [2 * 10**9, 500 * 2**20, 1500, 4096, 7]
    for bad in ("12XB", "-1MB", "0", "GB"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    source = data_dir / "kvm" / "kvm_fixed" / "research_final"
    for flags in (["--max-shard-size", "12XB"], ["--dtype", "int8"], ["--push-to-hub", "not a repo"]):
        with pytest.raises(SystemExit) as exit_info:
            convert("kvm", source, tmp_path / "out", *flags)
        assert exit_info.value.code == 2 and "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----- a SOURCE of the wrong kind: said first, with what was expected ------------------------------------------
@pytest.mark.parametrize("architecture, relative, says", [
    ("kvm", "nanochat/tiny_sl/base_checkpoints/d2",
     ["is a nanochat checkpoint folder", "expects a KVM research checkpoint", "convert maglev"]),
    ("kvm", "nanochat/tiny_sl", ["is nanochat's base folder", "convert maglev"]),
    ("kvm", "kvm/kvm_fixed/research", ["is a KVM research run folder", "model_step000050.pt --config",
                                       "config.yaml"]),
    ("maglev", "kvm/kvm_fixed/research_final",
     ["is a KVM research save_pretrained folder", "expects a nanochat checkpoint folder", "convert kvm"]),
    ("maglev", "kvm/kvm_fixed/research/model_step000050.pt", ["is a KVM research trainer checkpoint", "convert kvm"]),
    ("maglev", "nanochat/tiny_sl", ["is nanochat's base folder", "tiny_sl/base_checkpoints/d2"]),
    ("maglev", "nanochat/tiny_sl/base_checkpoints", ["is a folder of nanochat checkpoint folders",
                                                     "base_checkpoints/d2"]),
    ("maglev", "nanochat/tiny_sl/base_checkpoints/d2/model_000010.pt",
     ["is a nanochat checkpoint file", "base_checkpoints/d2 (with --step 10)"]),
])
def test_a_source_of_the_wrong_kind_is_named_first(data_dir, tmp_path, capsys, architecture, relative, says):
    err = fails_cleanly(capsys, tmp_path / "out", architecture, data_dir / relative, tmp_path / "out")
    assert f"{data_dir / relative} is " in err and all(text in err for text in says), err
    assert "no tokenizer" not in err and "could not find" not in err  # never a missing tokenizer first


def test_a_converted_or_empty_folder_is_named(tmp_path, capsys):
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "config.json").write_text(json.dumps({"model_type": "kvm"}))
    err = fails_cleanly(capsys, tmp_path / "out", "maglev", converted, tmp_path / "out")
    assert "already converted by kvm-maglev (model_type kvm)" in err and "kvm-maglev push" in err
    (tmp_path / "empty").mkdir()
    err = fails_cleanly(capsys, tmp_path / "out", "kvm", tmp_path / "empty", tmp_path / "out")
    assert "is a folder with no checkpoint in it" in err


def test_the_source_argument_has_one_name(capsys):
    for architecture in ("kvm", "maglev"):
        with pytest.raises(SystemExit):
            convert(architecture, "--help")
        assert "usage:" in (usage := capsys.readouterr().out) and " source out" in usage, usage


# ----- the output folder: the user's umask; a stopped conversion leaves nothing --------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_out_is_created_with_the_users_umask(data_dir, tmp_path, umask):
    previous = os.umask(umask)
    try:
        assert convert("kvm", data_dir / "kvm" / "kvm_fixed" / "research_final", tmp_path / "out") == 0
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


# Runs the command line and stops it once the folder is written and checked, before it is moved into place: there
# it tells the test (one byte on the pipe whose descriptor is argv[1]) and waits, in Python code so that the signal's
# handler runs however the kernel delivers it, until the test's signal arrives.
STOPPED = r"""
import os, signal, sys, time
from kvm_maglev.cli import main
from kvm_maglev.convert import export

# as in a terminal: a shell starts background jobs (a test run with &) with SIGINT ignored, and Python keeps that
signal.signal(signal.SIGINT, signal.default_int_handler)
ready, written = int(sys.argv[1]), export._check_written
def check_then_wait_for_signal(*args, **kwargs):
    written(*args, **kwargs)
    os.write(ready, b"1")
    os.close(ready)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise SystemExit("the test's signal never arrived")
export._check_written = check_then_wait_for_signal
sys.exit(main(sys.argv[2:]))
"""


def wait_for_byte(fd: int, timeout: float) -> bytes:
    """One byte from the pipe fd; b"" when its writer closed it or nothing came within timeout seconds."""
    readable, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1) if readable else b""


@pytest.mark.parametrize("signal_name, exit_code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_stopped_conversion_cleans_up_and_says_so_in_one_line(data_dir, tmp_path, signal_name, exit_code):
    out = tmp_path / "out"
    ready_read, ready_write = os.pipe()
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: progress bars cannot fill it and block
        process = subprocess.Popen(
            [sys.executable, "-c", STOPPED, str(ready_write), "convert", "kvm",
             str(data_dir / "kvm" / "kvm_fixed" / "research_final"), str(out)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(ready_write,),
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        os.close(ready_write)  # the child holds the only write end: its exit ends the wait below
        try:
            reached = wait_for_byte(ready_read, timeout=300)
            if reached:
                process.send_signal(getattr(signal, signal_name))
            process.wait(timeout=300)
        finally:
            os.close(ready_read)
            if process.poll() is None:
                process.kill()
        stderr.seek(0)
        result = stderr.read()
    assert reached, f"the conversion ended before it was written and checked:\n{result[-3000:]}"
    assert process.returncode == exit_code, result[-3000:]
    errors = [line for line in result.splitlines() if line.startswith("error:")]
    assert errors == [f"error: kvm-maglev convert stopped by {signal_name}; its temporary files were removed"]
    assert "Traceback" not in result
    assert os.listdir(tmp_path) == []  # neither OUT nor the hidden temporary folder


# ----- the folder's code on a transformers too old for it: one clear line --------------------------------------
OLD_TRANSFORMERS = r"""
import importlib.util, sys
import transformers
transformers.__version__ = "4.57.1"
spec = importlib.util.spec_from_file_location("configuration_under_test", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as transformers loads a folder's code
try:
    spec.loader.exec_module(module)
    print("imported")
except ImportError as error:
    print(f"ImportError: {error}")
"""


@pytest.mark.parametrize("architecture", ["kvm", "maglev"])
def test_remote_code_names_the_transformers_it_needs(architecture, tmp_path):
    from kvm_maglev.models.hub_code import hub_code_files

    path = tmp_path / f"configuration_{architecture}.py"
    path.write_text(hub_code_files(architecture)[path.name])
    result = subprocess.run([sys.executable, "-c", OLD_TRANSFORMERS, str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip().splitlines() == [
        "ImportError: KVM and Maglev models need transformers >= 5.17 (installed: 4.57.1); "
        "upgrade with: pip install -U 'transformers>=5.17'"], result.stdout + result.stderr
