"""Publishing to and loading from the Hub, end to end against the local Hub test double.

Every client step runs in a fresh Python process: huggingface_hub reads HF_ENDPOINT and
HF_HOME when it is imported, and other test modules import it into this process first.
Loading steps block `kvm_maglev` so they prove a user without our package can load the models.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hub_server import HubServer

CLIENT_TIMEOUT_S = 240
# Loading steps must work without our package, like on a user's machine.
_BLOCK_PACKAGE = "import sys; sys.modules['kvm_maglev'] = None\n"
_HUB_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                 "TRANSFORMERS_CACHE", "HF_MODULES_CACHE", "HF_TOKEN_PATH", "HF_HUB_ETAG_TIMEOUT")


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


def client_env(hub: HubServer, hf_home: Path, *, token: bool = True, offline: bool = False) -> dict:
    """Environment of a client process: our Hub, its own HF_HOME, a dummy token, no xet."""
    env = {k: v for k, v in os.environ.items() if k not in _HUB_ENV_VARS and k != "HF_TOKEN"}
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_XET="1",  # the double speaks the LFS basic transfer, not xet
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    if token:
        env["HF_TOKEN"] = hub.token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_client(code: str, env: dict, payload: dict, *, block_package: bool = True) -> dict:
    """Runs `code` in a new interpreter with `ARGS` = payload; returns the JSON it prints last."""
    prelude = (_BLOCK_PACKAGE if block_package else "") + "import json, sys\nARGS = json.loads(sys.argv[1])\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code), json.dumps(payload)],
        env=env,
        stdin=subprocess.DEVNULL,  # a trust_remote_code prompt must fail, not hang
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        cwd=str(Path(__file__).parent),
    )
    assert result.returncode == 0, f"client failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- what gets published ------------------------------------------------------------------------

# A tiny remote-code model: a Llama variant under its own model_type, so loading it by repo id
# needs the code files from the Hub (AutoModel knows nothing about "tiny-remote").
REMOTE_CONFIG_PY = '''\
"""Configuration of a tiny remote-code test model."""
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny-remote"
'''
REMOTE_MODELING_PY = '''\
"""A tiny remote-code test model: Llama with a learned output scale."""
import torch
from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.output_scale = torch.nn.Parameter(torch.full((1,), 0.5))

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * self.output_scale
        return output
'''

PUBLISH = r'''
import torch
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import argparse
from kvm_maglev import hub as push_command
from kvm_maglev.hub import push_folder

work = Path(ARGS["work"])
torch.manual_seed(0)

def tiny_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world", "the hub serves tiny models", "keys values means"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")

def tiny_config(cls, vocab):
    return cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)

def save(model, tokenizer, folder, source):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlibrary_name: transformers\ntags:\n- test\n---\n# Tiny test model\n\n"
        f"Source checkpoint: `{source}`\n")

tokenizer = tiny_tokenizer()
prompt_ids = tokenizer("hello world the hub", return_tensors="pt").input_ids
out = {"prompt_ids": prompt_ids.tolist()}

# 1. a built-in architecture, pushed with the library function, twice (second is a no-op)
llama = LlamaForCausalLM(tiny_config(LlamaConfig, len(tokenizer))).eval()
llama_dir = work / "llama"
save(llama, tokenizer, llama_dir, "runs/llama/step_000100.pt")
out["llama_first"] = push_folder(llama_dir, "test-org/tiny-llama")
out["llama_again"] = push_folder(llama_dir, "test-org/tiny-llama")
out["llama_logits"] = llama(prompt_ids).logits.tolist()

# 2. a changed model on branch "dev", through the command line
with torch.no_grad():
    llama.lm_head.weight.mul_(-1.0)
save(llama, tokenizer, llama_dir, "runs/llama/step_000200.pt")
parser = argparse.ArgumentParser()
push_command.add_arguments(parser)
assert push_command.run(parser.parse_args([str(llama_dir), "test-org/tiny-llama", "--revision", "dev"])) == 0
out["llama_dev_logits"] = llama(prompt_ids).logits.tolist()

# 3. remote code, to a private repo
sys.path.insert(0, ARGS["code_dir"])
from tiny_remote.configuration_tiny_remote import TinyRemoteConfig
from tiny_remote.modeling_tiny_remote import TinyRemoteForCausalLM
TinyRemoteConfig.register_for_auto_class("AutoConfig")
TinyRemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
remote = TinyRemoteForCausalLM(tiny_config(TinyRemoteConfig, len(tokenizer))).eval()
remote_dir = work / "remote"
save(remote, tokenizer, remote_dir, "runs/remote/final")
out["remote_commit"] = push_folder(remote_dir, "test-user/tiny-remote", private=True)
out["remote_files"] = sorted(p.name for p in remote_dir.iterdir())
out["remote_logits"] = remote(prompt_ids).logits.tolist()
out["remote_generated"] = remote.generate(prompt_ids, max_new_tokens=5, do_sample=False).tolist()
print(json.dumps(out))
'''

LOAD = r'''
import os, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer

prompt = torch.tensor(ARGS["prompt_ids"])
out = {}

def logits(model):
    with torch.no_grad():
        return model(prompt).logits.tolist()

tok = AutoTokenizer.from_pretrained("test-org/tiny-llama")
out["tokenizer_ids"] = tok("hello world the hub").input_ids
out["llama_logits"] = logits(AutoModelForCausalLM.from_pretrained("test-org/tiny-llama"))
out["llama_dev_logits"] = logits(AutoModelForCausalLM.from_pretrained("test-org/tiny-llama", revision="dev"))

remote = AutoModelForCausalLM.from_pretrained("test-user/tiny-remote", trust_remote_code=True)
out["remote_class_module"] = type(remote).__module__
out["remote_logits"] = logits(remote)
out["remote_generated"] = remote.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
out["remote_tokenizer_ids"] = AutoTokenizer.from_pretrained("test-user/tiny-remote", trust_remote_code=True).encode("hello world the hub")
modules = Path(os.environ["HF_HOME"]) / "modules" / "transformers_modules"
out["module_files"] = sorted(str(p.relative_to(modules)) for p in modules.rglob("*.py"))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory):
    """Pushes the tiny models once; returns what the publishing process saw."""
    work = tmp_path_factory.mktemp("publish")
    package = work / "code" / "tiny_remote"  # flat relative imports need a package, as in ours
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG_PY)
    (package / "modeling_tiny_remote.py").write_text(REMOTE_MODELING_PY)
    env = client_env(hub, tmp_path_factory.mktemp("hf_home_publish"))
    payload = {"work": str(work), "code_dir": str(package.parent)}
    return run_client(PUBLISH, env, payload, block_package=False)


@pytest.fixture(scope="module")
def downloaded(hub, published, tmp_path_factory):
    """Loads everything by repo id in a fresh HF_HOME, without our package."""
    hf_home = tmp_path_factory.mktemp("hf_home_load")
    result = run_client(LOAD, client_env(hub, hf_home), {"prompt_ids": published["prompt_ids"]})
    return hf_home, result


def assert_close(actual, expected, atol=1e-5):
    import torch

    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=atol, rtol=0)


def test_push_creates_repo_and_commit_naming_the_source(hub, published):
    repo = hub.repo("test-org/tiny-llama")
    main = repo.resolve("main")
    assert main.oid == published["llama_first"]
    assert main.title == "Upload llama model converted from runs/llama/step_000100.pt"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(main.files)
    assert main.files["model.safetensors"].lfs_sha256 is not None  # weights went through LFS
    assert not repo.private


def test_second_push_of_same_folder_makes_no_commit(hub, published):
    assert published["llama_again"] == published["llama_first"]
    history = [c.title for c in hub.repo("test-org/tiny-llama").commits.values()]
    assert history.count("Upload llama model converted from runs/llama/step_000100.pt") == 1


def test_revision_branch_holds_the_changed_model(hub, published):
    repo = hub.repo("test-org/tiny-llama")
    dev = repo.resolve("dev")
    assert repo.resolve("main").oid == published["llama_first"]  # main untouched
    assert dev.parent == published["llama_first"]
    assert dev.title.endswith("runs/llama/step_000200.pt")
    assert dev.files["model.safetensors"].lfs_sha256 != repo.resolve("main").files["model.safetensors"].lfs_sha256


def test_private_repo_is_hidden_without_token(hub, published, tmp_path):
    assert hub.repo("test-user/tiny-remote").private
    code = """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError
    try:
        hf_hub_download("test-user/tiny-remote", "config.json")
        print(json.dumps({"hidden": False}))
    except RepositoryNotFoundError:
        print(json.dumps({"hidden": True}))
    """
    assert run_client(code, client_env(hub, tmp_path, token=False), {})["hidden"]


def test_token_is_never_published_nor_sent_to_storage(hub, published, downloaded):
    token = hub.token.encode()
    for repo in hub.state.repos.values():
        assert all(token not in blob for blob in repo.blobs.values())
        assert all(token not in blob for blob in repo.lfs.values())
    cdn_requests = [r for r in hub.requests if r[0] == "cdn"]
    assert cdn_requests and all(r[4] is None for r in cdn_requests)


def test_load_by_repo_id_matches_the_pushed_models(published, downloaded):
    _, loaded = downloaded
    assert loaded["tokenizer_ids"] == published["prompt_ids"][0]
    assert loaded["remote_tokenizer_ids"] == published["prompt_ids"][0]
    assert_close(loaded["llama_logits"], published["llama_logits"])
    assert_close(loaded["llama_dev_logits"], published["llama_dev_logits"])
    assert_close(loaded["remote_logits"], published["remote_logits"])
    assert loaded["remote_generated"] == published["remote_generated"]


def test_remote_code_is_fetched_into_module_cache_pinned_by_commit(published, downloaded):
    _, loaded = downloaded
    commit = published["remote_commit"]
    assert loaded["remote_class_module"].startswith("transformers_modules.")
    assert {"configuration_tiny_remote.py", "modeling_tiny_remote.py"} <= set(published["remote_files"])
    pinned = [f for f in loaded["module_files"] if commit in f.split(os.sep)]
    assert {Path(f).name for f in pinned} >= {"configuration_tiny_remote.py", "modeling_tiny_remote.py"}


def test_offline_loading_from_cache_makes_no_request(hub, published, downloaded):
    hf_home, online = downloaded
    before = len(hub.requests)
    offline = run_client(LOAD, client_env(hub, hf_home, offline=True), {"prompt_ids": published["prompt_ids"]})
    assert len(hub.requests) == before
    for key in ("llama_logits", "llama_dev_logits", "remote_logits"):
        assert_close(offline[key], online[key], atol=0)
    assert offline["remote_generated"] == online["remote_generated"]


FINETUNE_AND_PUSH = r'''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("test-org/tiny-llama")
tokenizer = AutoTokenizer.from_pretrained("test-org/tiny-llama")
batch = tokenizer(["the hub serves tiny models"], return_tensors="pt")
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
loss = model(**batch, labels=batch.input_ids).loss
loss.backward()
optimizer.step()
model.eval()
commit = model.push_to_hub("test-user/tiny-llama-finetuned", commit_message="Fine-tune one step")
tokenizer.push_to_hub("test-user/tiny-llama-finetuned")
prompt = torch.tensor(ARGS["prompt_ids"])
with torch.no_grad():
    print(json.dumps({"commit": commit.oid, "logits": model(prompt).logits.tolist()}))
'''

RELOAD_FINETUNED = r'''
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("test-user/tiny-llama-finetuned")
with torch.no_grad():
    print(json.dumps({"logits": model(torch.tensor(ARGS["prompt_ids"])).logits.tolist()}))
'''


def test_model_push_to_hub_after_finetuning_reloads(hub, published, tmp_path):
    payload = {"prompt_ids": published["prompt_ids"]}
    tuned = run_client(FINETUNE_AND_PUSH, client_env(hub, tmp_path / "tune"), payload)
    repo = hub.repo("test-user/tiny-llama-finetuned")
    assert repo.resolve(tuned["commit"]).title == "Fine-tune one step"
    assert "tokenizer.json" in repo.resolve("main").files
    reloaded = run_client(RELOAD_FINETUNED, client_env(hub, tmp_path / "reload"), payload)
    assert_close(reloaded["logits"], tuned["logits"])
    with pytest.raises(AssertionError):
        assert_close(reloaded["logits"], published["llama_logits"])
