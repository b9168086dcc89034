"""The Maglev converter: nanochat fixture parity (both checkpoints), Maglev research checkpoints
(memory tensors, prefiller, key maps), atomic output, and loading where kvm_maglev is absent."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvm_maglev.cache_sizes import cache_bytes
from kvm_maglev.convert import cli as convert_cli
from kvm_maglev.convert import maglev as converter
from kvm_maglev.models.maglev.cache_maglev import MaglevCache
from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig
from kvm_maglev.models.maglev.modeling_maglev import MaglevForCausalLM

TOLERANCE = 1e-4



@pytest.fixture(scope="module")
def fixture_dir(data_dir) -> Path:
    return data_dir / "nanochat" / "tiny_sl"


@pytest.fixture(scope="module")
def reference(fixture_dir) -> dict[str, torch.Tensor]:
    return load_file(fixture_dir / "reference.safetensors")


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    convert_cli.add_arguments(parser)
    return convert_cli.run(parser.parse_args(["maglev", *argv]))


@pytest.fixture(scope="module", params=[10, 11], ids=["plain", "orig_mod_bf16"])
def converted(request, fixture_dir, tmp_path_factory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp(f"maglev_step{request.param}") / "model"
    assert run_cli(str(fixture_dir / "base_checkpoints" / "d2"), str(out), "--step", str(request.param)) == 0
    return request.param, out


@pytest.fixture(scope="module")
def fixture_model(converted) -> MaglevForCausalLM:
    return MaglevForCausalLM.from_pretrained(converted[1], dtype=torch.float32).eval()


# ----- nanochat parity (memory off) ---------------------------------------------------------------------
def test_converted_folder_layout(converted):
    _, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_maglev.MaglevConfig",
        "AutoModel": "modeling_maglev.MaglevModel",
        "AutoModelForCausalLM": "modeling_maglev.MaglevForCausalLM",
    }
    assert config["use_memory"] is False and config["window_pattern"] == "SL"
    for name in ("model.safetensors", "configuration_maglev.py", "modeling_maglev.py"):
        assert (out / name).is_file(), name
    assert not list(out.parent.glob(".model.*")), "staging folder left behind"


@torch.no_grad()
def test_full_forward_matches_nanochat(fixture_model, reference):
    logits = fixture_model(reference["input_ids"], use_cache=False).logits
    error = (logits - reference["logits_full"]).abs().max().item()
    assert error <= TOLERANCE, error


@torch.no_grad()
def test_cached_decoding_matches_nanochat(fixture_model, reference):
    ids, prompt = reference["input_ids"], int(reference["prefill_len"])
    cache = MaglevCache(fixture_model.config)
    logits = [fixture_model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
    for t in range(prompt, ids.shape[1]):
        logits.append(fixture_model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    error = (torch.cat(logits, 1) - reference["decode_logits"]).abs().max().item()
    assert error <= TOLERANCE, error
    assert cache.nbytes() == cache_bytes(fixture_model.config, ids.shape[1], batch_size=2, dtype=torch.float32)


@torch.no_grad()
@pytest.mark.parametrize("prompt_len,chunk", [(1, 1), (2, 7), (63, 1), (80, 8), (129, 31)])
def test_cached_prompts_of_any_length_match_full_forward(fixture_model, reference, prompt_len, chunk):
    """Includes multi-token steps on a non-empty cache, whose first token smears with the cached
    embedding (nanochat's own cache does not, and differs from its full forward there)."""
    ids = reference["input_ids"]
    cache = MaglevCache(fixture_model.config)
    logits = [fixture_model(ids[:, :prompt_len], past_key_values=cache, use_cache=True).logits]
    for start in range(prompt_len, ids.shape[1], chunk):
        logits.append(fixture_model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True).logits)
    error = (torch.cat(logits, 1) - reference["logits_full"]).abs().max().item()
    assert error <= TOLERANCE, error


@torch.no_grad()
def test_loss_matches_nanochat(fixture_model, reference):
    ids = reference["input_ids"]
    logits = fixture_model(ids[:, :-1], use_cache=False).logits
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    assert (per_token - reference["loss_per_token"]).abs().max().item() <= TOLERANCE
    loss = fixture_model(ids, labels=ids).loss
    assert abs(loss.item() - reference["loss_per_token"].mean().item()) <= TOLERANCE


@torch.no_grad()
def test_greedy_generation_matches_nanochat(fixture_model, reference):
    prompt = reference["greedy_prompt"][None]
    generated = fixture_model.generate(prompt, max_new_tokens=80, do_sample=False)
    assert torch.equal(generated[0, prompt.shape[1]:], reference["greedy_ids"])


# ----- Maglev research checkpoints (memory on) ------------------------------------------------------------
def research_state_dict(model: MaglevForCausalLM) -> dict[str, torch.Tensor]:
    """Our state dict under the research names (inverse of the converter's mapping)."""
    inverse = [(ours, research) for research, ours in converter.DEFAULT_KEY_MAP.items()]
    state = {}
    for key, value in model.state_dict().items():
        for ours, research in inverse:
            pattern = converter.compile_key_map({ours: research})
            renamed = converter.rename_key(key, pattern)
            if renamed is not None:
                state[renamed] = value.clone()
                break
        else:
            raise AssertionError(f"no research name for {key}")
    return state


def write_research_checkpoint(folder: Path, model: MaglevForCausalLM, step: int, compiled: bool = False) -> None:
    config = model.config
    folder.mkdir(parents=True, exist_ok=True)
    state = research_state_dict(model)
    if compiled:
        state = {f"_orig_mod.{k}": (v.bfloat16() if "wte" in k else v) for k, v in state.items()}
    torch.save(state, folder / f"model_{step:06d}.pt")
    meta = {
        "step": step,
        "model_config": {"sequence_len": config.max_position_embeddings, "vocab_size": config.vocab_size,
                         "n_layer": config.num_hidden_layers, "n_head": config.num_attention_heads,
                         "n_kv_head": config.num_key_value_heads, "n_embd": config.hidden_size,
                         "window_pattern": config.window_pattern},
        "maglev": {name: getattr(config, name) for name in converter.MAGLEV_META_FIELDS},
    }
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta))


def research_folder(root: Path, fixture_dir: Path) -> Path:
    """A nanochat base-folder layout (<base>/base_checkpoints/<tag>/, <base>/tokenizer/) for written checkpoints."""
    (root / "tokenizer").mkdir(parents=True)
    shutil.copy(fixture_dir / "tokenizer" / "tokenizer.pkl", root / "tokenizer" / "tokenizer.pkl")
    return root / "base_checkpoints" / "d1"


def maglev_model(shares: bool, seed: int = 0) -> MaglevForCausalLM:
    torch.manual_seed(seed)
    config = MaglevConfig(vocab_size=360, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=32, sliding_window=8,
                          prefiller_window_pattern="SL", prefiller_shares_blocks=shares, consistency_weight=0.5)
    model = MaglevForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


@torch.no_grad()
@pytest.mark.parametrize("shares", [True, False])
def test_maglev_checkpoint_round_trip(tmp_path, fixture_dir, shares):
    model = maglev_model(shares)
    source = research_folder(tmp_path / "research", fixture_dir)
    write_research_checkpoint(source, model, step=3)
    write_research_checkpoint(source, maglev_model(shares, seed=1), step=7, compiled=True)
    ids = torch.randint(0, 100, (2, 30))

    assert run_cli(str(source), str(tmp_path / "p_only"), "--step", "3") == 0
    p_only = MaglevForCausalLM.from_pretrained(tmp_path / "p_only").eval()
    assert not p_only.config.has_prefiller and p_only.model.prefiller_layers is None
    assert p_only.config.consistency_weight == 0.5 and p_only.config.sliding_window == 8
    assert torch.allclose(p_only(ids, use_cache=False).logits, model(ids, use_cache=False).logits, atol=1e-5)
    with pytest.raises(ValueError, match="memory_prefill"):
        MaglevForCausalLM.from_pretrained(tmp_path / "p_only", memory_prefill="prefiller")

    assert run_cli(str(source), str(tmp_path / "with_q"), "--step", "3", "--keep-prefiller") == 0
    with_q = MaglevForCausalLM.from_pretrained(tmp_path / "with_q", memory_prefill="prefiller").eval()
    model.config.memory_prefill = "prefiller"
    assert torch.allclose(with_q(ids, use_cache=False).logits, model(ids, use_cache=False).logits, atol=1e-5)
    assert (with_q.model.prefiller_layers is None) == shares

    # default step = newest (7, saved compiled with a bf16 embedding)
    assert run_cli(str(source), str(tmp_path / "newest")) == 0
    newest = MaglevForCausalLM.from_pretrained(tmp_path / "newest").eval()
    expected = maglev_model(shares, seed=1).model.embed_tokens.weight.bfloat16().float()
    assert torch.equal(newest.model.embed_tokens.weight, expected)


def test_key_map_override_and_unknown_keys(tmp_path, fixture_dir, capsys):
    model = maglev_model(shares=True)
    source = research_folder(tmp_path / "research", fixture_dir)
    write_research_checkpoint(source, model, step=1)
    state = torch.load(source / "model_000001.pt", weights_only=True)
    state["mem0"] = state.pop("memory_init")
    torch.save(state, source / "model_000001.pt")
    assert run_cli(str(source), str(tmp_path / "out")) == 2
    assert "mem0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps({"mem0": "model.memory_init"}))
    assert run_cli(str(source), str(tmp_path / "out"), "--key-map", str(key_map)) == 0
    loaded = MaglevForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.model.memory_init, model.model.memory_init)


def test_output_folder_protection_and_bad_inputs(tmp_path, fixture_dir, capsys):
    source = str(fixture_dir / "base_checkpoints" / "d2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert run_cli(source, str(out)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    assert run_cli(source, str(out), "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert run_cli(source, str(tmp_path / "x"), "--step", "99") == 2
    assert "step 99" in capsys.readouterr().err
    assert run_cli(source, str(tmp_path / "y"), "--keep-prefiller") == 2
    assert "--keep-prefiller" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_missing_lambdas_are_patched_like_nanochat(fixture_dir):
    state, meta = converter.read_checkpoint(fixture_dir / "base_checkpoints" / "d2", step=10)
    del state["resid_lambdas"], state["x0_lambdas"]
    del meta["model_config"]["window_pattern"]
    config = converter.build_config(meta, state)
    assert config.window_pattern == "L"
    model = converter.build_model(config, converter.convert_state_dict(state, config))
    assert torch.equal(model.model.residual_lambdas, torch.ones(4))
    assert torch.equal(model.model.x0_lambdas, torch.zeros(4))


# ----- loading where kvm_maglev is not importable -----------------------------------------------------------
LOADER = r"""
import importlib.abc, json, sys
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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder, reference_path = sys.argv[1], sys.argv[2]
reference = load_file(reference_path)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert "kvm_maglev" not in type(model).__module__
with torch.no_grad():
    error = (model(reference["input_ids"], use_cache=False).logits - reference["logits_full"]).abs().max().item()
    generated = model.generate(reference["greedy_prompt"][None], max_new_tokens=16, do_sample=False)
from transformers import AutoConfig, AutoModel
base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
assert type(base).__name__ == "MaglevModel" and AutoConfig.from_pretrained(folder, trust_remote_code=True).model_type == "maglev"
with torch.no_grad():
    hidden = base(reference["input_ids"][:, :8], use_cache=False).last_hidden_state
# outside no_grad the linears take nn.Linear's kernel, not oneDNN: equal up to rounding
assert torch.allclose(hidden, model.model(reference["input_ids"][:, :8], use_cache=False).last_hidden_state, atol=1e-5)
print(json.dumps({"error": error, "new": generated[0, 80:].tolist(), "module": type(model).__module__}))
"""


def test_converted_folder_loads_without_kvm_maglev(reference, fixture_dir, tmp_path):
    folder = tmp_path / "converted"
    assert run_cli(str(fixture_dir / "base_checkpoints" / "d2"), str(folder)) == 0  # newest: step 11
    result = subprocess.run(
        [sys.executable, "-c", LOADER, str(folder), str(fixture_dir / "reference.safetensors")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
             "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules")
    assert report["error"] <= TOLERANCE
    assert report["new"] == reference["greedy_ids"][:16].tolist()
