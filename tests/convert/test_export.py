"""The safe model-folder writer and the model card, on a tiny transformers built-in model."""

import json

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from kvm_maglev.cache_sizes import cache_bytes, full_attention_cache_bytes
from kvm_maglev.convert.cards import Provenance, file_sha256, format_bytes, format_count, render_model_card
from kvm_maglev.convert.export import check_state_dict, expected_shapes, write_model_folder
from kvm_maglev.tokenization.gpt2 import generation_token_fields, load_research_tokenizer

VOCAB = 512


def _tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def tokenizer(data_dir):
    return load_research_tokenizer(data_dir / "kvm" / "kvm_fixed" / "research_final", model_max_length=64)


def _weights(folder):
    index = folder / "model.safetensors.index.json"
    if index.exists():
        tensors = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(folder / shard))
        return tensors
    return load_file(folder / "model.safetensors")


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_writes_complete_folder_that_reloads(tmp_path, tokenizer):
    model = _tiny_llama()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fields = generation_token_fields(tokenizer, VOCAB)
    out = write_model_folder(model, tmp_path / "out", tokenizer=tokenizer, card_text="---\nlicense: mit\n---\nhi",
                             generation_fields=fields, extra_files={"notes/extra.txt": "x"}, progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert (out / "notes" / "extra.txt").read_text() == "x"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == generation.pad_token_id == tokenizer.eos_token_id
    assert generation.suppress_tokens == list(range(500, VOCAB))
    assert AutoTokenizer.from_pretrained(out).encode("hello world") == tokenizer.encode("hello world")
    assert _leftovers(tmp_path, "out") == []


def test_bfloat16_output_reloads_to_same_weights(tmp_path):
    model = _tiny_llama()
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    out = write_model_folder(model, tmp_path / "bf16", dtype="bfloat16", progress=False)
    stored = load_file(out / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_sharded_output_reloads_to_same_weights(tmp_path):
    model = _tiny_llama()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    out = write_model_folder(model, tmp_path / "sharded", max_shard_size="40KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (out / "model.safetensors").exists()
    assert set(_weights(out)) == set(expected)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_tied_embeddings_saved_once_and_stay_tied(tmp_path):
    model = _tiny_llama(tie=True)
    out = write_model_folder(model, tmp_path / "tied", progress=False)
    assert "lm_head.weight" not in _weights(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.lm_head.weight, model.model.embed_tokens.weight)


def test_existing_out_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match="already exists"):
        write_model_folder(_tiny_llama(), out, progress=False)
    assert (out / "keep.txt").read_text() == "old"
    write_model_folder(_tiny_llama(), out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert _leftovers(tmp_path, "out") == []


def test_failure_mid_write_leaves_nothing(tmp_path, tokenizer, monkeypatch):
    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_model_folder(_tiny_llama(), tmp_path / "out", tokenizer=tokenizer, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failure_during_overwrite_keeps_old_out(tmp_path, tokenizer, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    monkeypatch.setattr(tokenizer, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError):
        write_model_folder(_tiny_llama(), out, tokenizer=tokenizer, overwrite=True, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "keep.txt").read_text() == "old"


def test_non_finite_logits_refused(tmp_path):
    model = _tiny_llama()
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite logits"):
        write_model_folder(model, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_folder_writer_dry_run_writes_nothing(tmp_path, tokenizer, capsys):
    out = write_model_folder(_tiny_llama(), tmp_path / "out", tokenizer=tokenizer, card_text="card",
                             dtype="float16", max_shard_size="40KB", dry_run=True)
    printed = capsys.readouterr().out
    assert not out.exists() and list(tmp_path.iterdir()) == []
    for expected in ("would write", "config.json", "model.safetensors", "torch.float16", "index.json", "README.md"):
        assert expected in printed


def test_custom_model_without_auto_class_refused(tmp_path):
    class MyModel(LlamaForCausalLM):
        pass

    with pytest.raises(ValueError, match="register_for_auto_class"):
        write_model_folder(MyModel(_tiny_llama().config), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bad_dtype_refused(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        write_model_folder(_tiny_llama(), tmp_path / "out", dtype="int8", progress=False)


def test_check_state_dict_lists_every_problem():
    expected = {"a": (2, 3), "b": (4,), "c": (1,), "d": (5, 5)}
    got = {"a": torch.zeros(2, 3), "b": torch.zeros(5), "d": torch.zeros(5, 4), "extra": torch.zeros(1)}
    with pytest.raises(ValueError) as error:
        check_state_dict(expected, got)
    message = str(error.value)
    assert "1 missing: c" in message and "1 unexpected: extra" in message
    assert "b: expected [4], got [5]" in message and "d: expected [5, 5], got [5, 4]" in message
    check_state_dict(expected_shapes(_tiny_llama()), _tiny_llama().state_dict())


# --- model cards ---


def test_maglev_card_from_config(tmp_path):
    from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig

    config = MaglevConfig(vocab_size=360, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, sliding_window=64, max_position_embeddings=64)
    source = tmp_path / "model_000010.pt"
    source.write_bytes(b"weights")
    card_text = render_model_card(
        config, num_parameters=3_456_789, license="mit", datasets=["karpathy/fineweb-edu-100b-shuffle"],
        base_model="someone/base", provenance=Provenance(str(source), file_sha256(source), 10),
    )
    card = ModelCard(card_text, ignore_metadata_errors=False)
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"custom_code", "maglev"} <= set(card.data.tags)
    assert card.data.license == "mit" and card.data.base_model == "someone/base"
    assert card.data.datasets == ["karpathy/fineweb-edu-100b-shuffle"]
    assert "trust_remote_code=True" in card_text and "arXiv:2608.02870" in card_text
    assert file_sha256(source) in card_text and "training step: 10" in card_text
    assert "3.46M (3,456,789)" in card_text
    for tokens in (4096, 32768, 131072, 1048576):
        ours = cache_bytes(config, tokens, batch_size=1, dtype=torch.bfloat16)
        full = full_attention_cache_bytes(config, tokens, batch_size=1, dtype=torch.bfloat16)
        assert f"{full / ours:.1f}x smaller" in card_text
    assert "| 1M |" in card_text and "| 4k |" in card_text


def test_kvm_card_from_config():
    from kvm_maglev.models.kvm.configuration_kvm import KVMConfig

    config = KVMConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, chunk_size=16,
                       window_chunks=2, sink_slots=1, state_budget_min=16)
    card_text = render_model_card(config, num_parameters=1000, license="apache-2.0")
    for tokens, label in ((4096, "4k"), (32768, "32k"), (131072, "128k"), (1048576, "1M")):
        ours = format_bytes(cache_bytes(config, tokens, batch_size=1, dtype=torch.bfloat16))
        full = format_bytes(full_attention_cache_bytes(config, tokens, batch_size=1, dtype=torch.bfloat16))
        assert f"| {label} | {ours} | {full} |" in card_text
    assert "arXiv:2605.09877" in card_text and "Goldstein" in card_text and "trust_remote_code=True" in card_text
    card = ModelCard(card_text, ignore_metadata_errors=False)
    assert {"custom_code", "kvm"} <= set(card.data.tags) and card.data.license == "apache-2.0"
    assert card.data.base_model is None and card.data.datasets is None
    assert "Not recorded." in card_text


def test_size_formatting():
    assert [format_bytes(n) for n in (1000, 1536, 10 * 2**20, 36 * 2**30)] == [
        "1000 B", "1.50 KiB", "10.00 MiB", "36.00 GiB"
    ]
    assert format_count(999) == "999" and format_count(124_439_808) == "124.44M (124,439,808)"


def test_card_rejects_unknown_architecture():
    with pytest.raises(ValueError, match="no model card template"):
        render_model_card(LlamaConfig(), num_parameters=10)


# --- end to end: a converted nanochat/Maglev checkpoint, loaded without this package ---

_FRESH_PROCESS_LOAD = """
import json, sys
sys.modules["kvm_maglev"] = None  # the folder must work with plain transformers
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
out, reference = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
with safe_open(reference, "pt") as f:
    ids, logits = f.get_tensor("input_ids")[:1, :48], f.get_tensor("logits_full")[:1, :48]
    messages = json.loads(f.metadata()["nanochat_reference"])["conversation"]["messages"]
    conv_ids = f.get_tensor("conv_ids").tolist()
with torch.no_grad():
    diff = (model(input_ids=ids).logits[..., :logits.shape[-1]] - logits).abs().max().item()
card = ModelCard.load(out + "/README.md", ignore_metadata_errors=False)
print(json.dumps({"diff": diff, "chat_ok": tok.apply_chat_template(messages, return_dict=False) == conv_ids,
                  "eos": GenerationConfig.from_pretrained(out).eos_token_id, "tags": card.data.tags}))
"""


def test_converted_maglev_folder_loads_without_package(tmp_path, data_dir):
    import subprocess
    import sys

    from kvm_maglev.convert import maglev as maglev_convert
    from kvm_maglev.tokenization.nanochat import load_nanochat_tokenizer, nanochat_generation_token_fields

    fixture = data_dir / "nanochat" / "tiny_sl"
    source = fixture / "base_checkpoints" / "d2"
    state, meta = maglev_convert.read_checkpoint(source, 10)
    config = maglev_convert.build_config(meta, state)
    model = maglev_convert.build_model(config, maglev_convert.convert_state_dict(state, config))
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    tokenizer = load_nanochat_tokenizer(fixture / "tokenizer", model_max_length=config.max_position_embeddings)
    checkpoint = source / "model_000010.pt"
    card = render_model_card(config, num_parameters=model.num_parameters(), license="mit",
                             provenance=Provenance(str(checkpoint), file_sha256(checkpoint), 10))
    out = write_model_folder(model, tmp_path / "maglev", tokenizer=tokenizer, card_text=card,
                             generation_fields=nanochat_generation_token_fields(tokenizer), progress=False)
    assert (out / "modeling_maglev.py").is_file() and (out / "tokenization_nanochat.py").is_file()
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_LOAD, str(out), str(fixture / "reference.safetensors")],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["diff"] < 1e-4
    assert loaded["chat_ok"] and loaded["eos"] == [355, 351] and "maglev" in loaded["tags"]


def test_generation_never_emits_padded_ids(tmp_path, tokenizer):
    model = _tiny_llama()
    with torch.no_grad():  # make the padded rows (500..511) win every argmax unless suppressed
        model.lm_head.weight.zero_()
        model.lm_head.weight[500:] = torch.randn(VOCAB - 500, model.config.hidden_size) * 10
    out = write_model_folder(model, tmp_path / "out", tokenizer=tokenizer,
                             generation_fields=generation_token_fields(tokenizer, VOCAB), progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([tokenizer.encode("hello world")])
    plain = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, suppress_tokens=None, eos_token_id=None)
    assert (plain[0, prompt.shape[1]:] >= 500).all()  # the setup really prefers padded ids
    for do_sample in (False, True):
        generated = reloaded.generate(prompt, max_new_tokens=6, do_sample=do_sample, eos_token_id=None)
        assert (generated[0, prompt.shape[1]:] < 500).all()


def test_progress_lines_without_tqdm(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)
    write_model_folder(_tiny_llama(), tmp_path / "out", progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert lines[0] == "[1/7] cast" and lines[-1] == "[7/7] move into place" and len(lines) == 7
