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

from tests.hub.hub_server import HubServer

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

PUBLISH = r"""
import argparse
import torch
from pathlib import Path
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from kvm_maglev.cli import main as cli_main
from kvm_maglev.convert.common import add_push_arguments
from kvm_maglev.hub import find_source_checkpoint, push_after_convert, push_folder

work = Path(ARGS["work"])
out = {}
torch.manual_seed(0)

def tiny_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world", "the hub serves tiny models", "keys values means"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")

def save_llama(model, tokenizer, folder, source):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlibrary_name: transformers\ntags:\n- test\n---\n# Tiny test model\n\n"
        f"Source checkpoint: `{source}`\n")

def reference(folder, prompt, key):
    # what the local folder computes: the loaded-by-repo-id model must match it exactly
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        out[key + "_logits"] = model(prompt).logits.tolist()
        out[key + "_generated"] = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    out[key + "_recorded_source"] = find_source_checkpoint(folder)
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        out[key + "_tokenizer_ids"] = tokenizer(ARGS["text"]).input_ids
        if tokenizer.chat_template:
            out[key + "_chat"] = tokenizer.apply_chat_template(ARGS["chat"], tokenize=False)

# 1. a built-in architecture, pushed with the library function, twice (the second is a no-op)
tokenizer = tiny_tokenizer()
llama_prompt = tokenizer(ARGS["text"], return_tensors="pt").input_ids
out["llama_prompt"] = llama_prompt.tolist()
llama = LlamaForCausalLM(LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
llama_dir = work / "llama"
save_llama(llama, tokenizer, llama_dir, "runs/llama/step_000100.pt")
out["llama_first"] = push_folder(llama_dir, "test-org/tiny-llama")
out["llama_again"] = push_folder(llama_dir, "test-org/tiny-llama")
out["llama_logits"] = llama(llama_prompt).logits.tolist()

# 2. a changed model on branch "dev", through the command line
with torch.no_grad():
    llama.lm_head.weight.mul_(-1.0)
save_llama(llama, tokenizer, llama_dir, "runs/llama/step_000200.pt")
assert cli_main(["push", str(llama_dir), "test-org/tiny-llama", "--revision", "dev"]) == 0
out["llama_dev_logits"] = llama(llama_prompt).logits.tolist()

# 3. our architectures: KVM converted, then pushed with `kvm-maglev push`; Maglev converted and
#    pushed in one go with `--push-to-hub ... --private`; both also pushed to branch "dev"
prompt = torch.tensor(ARGS["prompt_ids"])
kvm_dir, maglev_dir = work / "kvm", work / "maglev"
assert cli_main(["convert", "kvm", ARGS["kvm_source"], str(kvm_dir)]) == 0
assert cli_main(["push", str(kvm_dir), "test-org/kvm-tiny"]) == 0
out["kvm_commit"] = push_folder(kvm_dir, "test-org/kvm-tiny")  # unchanged: returns the same commit
assert cli_main(["push", str(kvm_dir), "test-org/kvm-tiny", "--revision", "dev"]) == 0
assert cli_main(["convert", "maglev", ARGS["maglev_source"], str(maglev_dir),
                 "--push-to-hub", "test-user/maglev-tiny", "--private"]) == 0
out["maglev_commit"] = push_folder(maglev_dir, "test-user/maglev-tiny")
hook = argparse.ArgumentParser()
add_push_arguments(hook)
push_after_convert(hook.parse_args(["--push-to-hub", "test-user/maglev-tiny", "--push-revision", "dev"]), maglev_dir)
assert push_after_convert(hook.parse_args([]), maglev_dir) is None
reference(kvm_dir, prompt, "kvm")
reference(maglev_dir, prompt, "maglev")
out["work"] = str(work)
out["code_files"] = {key: sorted(p.name for p in folder.glob("*.py")) for key, folder in (("kvm", kvm_dir), ("maglev", maglev_dir))}
print(json.dumps(out))
"""

LOAD = r"""
import os, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer

out = {}
try:
    import kvm_maglev  # noqa: F401 - must fail: users load from the Hub without our package
    out["package_importable"] = True
except ImportError:
    out["package_importable"] = False

def load(repo_id, key, prompt, revision=None, remote=True, tokenizer_too=False):
    model = AutoModelForCausalLM.from_pretrained(repo_id, revision=revision, trust_remote_code=remote).eval()
    out[key + "_class_module"] = type(model).__module__
    with torch.no_grad():
        out[key + "_logits"] = model(prompt).logits.tolist()
        if remote:
            out[key + "_generated"] = model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    if tokenizer_too:
        tokenizer = AutoTokenizer.from_pretrained(repo_id, revision=revision, trust_remote_code=remote)
        out[key + "_tokenizer_ids"] = tokenizer(ARGS["text"]).input_ids
        if tokenizer.chat_template:
            out[key + "_chat"] = tokenizer.apply_chat_template(ARGS["chat"], tokenize=False)

llama_prompt = torch.tensor(ARGS["llama_prompt"])
load("test-org/tiny-llama", "llama", llama_prompt, remote=False, tokenizer_too=True)
load("test-org/tiny-llama", "llama_dev", llama_prompt, revision="dev", remote=False)
prompt = torch.tensor(ARGS["prompt_ids"])
for repo_id, key in (("test-org/kvm-tiny", "kvm"), ("test-user/maglev-tiny", "maglev")):
    load(repo_id, key, prompt, tokenizer_too=True)
    load(repo_id, key + "_dev", prompt, revision="dev", tokenizer_too=True)
modules = Path(os.environ["HF_HOME"]) / "modules" / "transformers_modules"
out["module_files"] = sorted(str(p.relative_to(modules)) for p in modules.rglob("*.py"))
print(json.dumps(out))
"""

PROMPT_IDS = [[1, 17, 5, 42, 9, 3, 28, 11]]  # inside both fixture vocabularies
TEXT = "hello world the hub"
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def published(hub, tmp_path_factory, data_dir):
    """Converts and pushes the models once; returns what the publishing process computed locally."""
    work = tmp_path_factory.mktemp("publish")
    payload = {
        "work": str(work),
        "kvm_source": str(data_dir / "kvm" / "kvm_fixed" / "research_final"),
        "maglev_source": str(data_dir / "nanochat" / "tiny_sl" / "base_checkpoints" / "d2"),
        "prompt_ids": PROMPT_IDS,
        "text": TEXT,
        "chat": CHAT,
    }
    env = client_env(hub, tmp_path_factory.mktemp("hf_home_publish"))
    return run_client(PUBLISH, env, payload, block_package=False)


def load_payload(published: dict) -> dict:
    return {
        "prompt_ids": PROMPT_IDS,
        "text": TEXT,
        "chat": CHAT,
        "llama_prompt": published["llama_prompt"],
    }


@pytest.fixture(scope="module")
def downloaded(hub, published, tmp_path_factory):
    """Loads everything by repo id in a fresh HF_HOME, without our package."""
    hf_home = tmp_path_factory.mktemp("hf_home_load")
    return hf_home, run_client(LOAD, client_env(hub, hf_home), load_payload(published))


def assert_close(actual, expected, atol=1e-5):
    import torch

    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), atol=atol, rtol=0)


def test_push_creates_repo_and_commit_naming_the_source(hub, published):
    repo = hub.repo("test-org/tiny-llama")
    main = repo.resolve("main")
    assert main.oid == published["llama_first"]
    assert main.title == "Upload llama model converted from step_000100.pt"  # no local path goes to the Hub
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(main.files)
    assert main.files["model.safetensors"].lfs_sha256 is not None  # weights went through LFS
    assert not repo.private


def test_second_push_of_same_folder_makes_no_commit(hub, published):
    assert published["llama_again"] == published["llama_first"]
    history = [c.title for c in hub.repo("test-org/tiny-llama").commits.values()]
    assert history.count("Upload llama model converted from step_000100.pt") == 1


def test_revision_branch_holds_the_changed_model(hub, published):
    repo = hub.repo("test-org/tiny-llama")
    dev = repo.resolve("dev")
    assert repo.resolve("main").oid == published["llama_first"]  # main untouched
    assert dev.parent == published["llama_first"]
    assert dev.title.endswith("from step_000200.pt")
    assert dev.files["model.safetensors"].lfs_sha256 != repo.resolve("main").files["model.safetensors"].lfs_sha256


def test_private_flag_hides_the_repo_without_token(hub, published, tmp_path):
    assert hub.repo("test-user/maglev-tiny").private
    assert not hub.repo("test-org/kvm-tiny").private
    code = """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError
    try:
        hf_hub_download("test-user/maglev-tiny", "config.json")
        print(json.dumps({"hidden": False}))
    except RepositoryNotFoundError:
        print(json.dumps({"hidden": True}))
    """
    assert run_client(code, client_env(hub, tmp_path, token=False), {})["hidden"]


def test_converted_models_are_published_with_their_card_tokenizer_and_code(hub, published, data_dir):
    sources = {"kvm": "model.safetensors", "maglev": "model_000011.pt"}
    for repo_id, key in (("test-org/kvm-tiny", "kvm"), ("test-user/maglev-tiny", "maglev")):
        repo = hub.repo(repo_id)
        main, dev = repo.resolve("main"), repo.resolve("dev")
        assert main.oid == published[f"{key}_commit"] == dev.oid  # same folder again: no new commit
        assert [c.title for c in repo.commits.values()] == ["initial commit", main.title]
        assert set(published["code_files"][key]) <= set(main.files)
        # the card and tokenizer go up in the same commit as the weights
        assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"} <= set(main.files)
        recorded = published[f"{key}_recorded_source"]  # read back from the card by push
        assert recorded == sources[key]  # the file name: no local path goes to the Hub
        assert main.title == f"Upload {key} model converted from {recorded}"
        card = repo.blobs[main.files["README.md"].git_oid].decode()
        assert f'repo = "{repo_id}"' in card and published["work"] not in card and str(data_dir) not in card


def test_token_is_never_published_nor_sent_to_storage(hub, published, downloaded):
    token = hub.token.encode()
    for repo in hub.state.repos.values():
        assert all(token not in blob for blob in repo.blobs.values())
        assert all(token not in blob for blob in repo.lfs.values())
    cdn_requests = [r for r in hub.requests if r[0] == "cdn"]
    assert cdn_requests and all(r[4] is None for r in cdn_requests)


def test_load_by_repo_id_matches_the_local_folders(published, downloaded):
    _, loaded = downloaded
    assert loaded["package_importable"] is False
    assert loaded["llama_tokenizer_ids"] == published["llama_prompt"][0]
    assert_close(loaded["llama_logits"], published["llama_logits"])
    assert_close(loaded["llama_dev_logits"], published["llama_dev_logits"])
    assert "kvm_tokenizer_ids" in published and "maglev_tokenizer_ids" in published  # conversions carry them
    assert "<|assistant_start|>" in published["maglev_chat"]  # nanochat's chat template came along
    for key in ("kvm", "maglev"):
        for loaded_key in (key, key + "_dev"):
            assert loaded[loaded_key + "_class_module"].startswith("transformers_modules.")
            assert_close(loaded[loaded_key + "_logits"], published[key + "_logits"], atol=1e-5)
            assert loaded[loaded_key + "_generated"] == published[key + "_generated"]
            assert loaded[loaded_key + "_tokenizer_ids"] == published[key + "_tokenizer_ids"]
            assert loaded.get(loaded_key + "_chat") == published.get(key + "_chat")


def test_remote_code_is_fetched_into_module_cache_pinned_by_commit(published, downloaded):
    _, loaded = downloaded
    for key in ("kvm", "maglev"):
        commit = published[f"{key}_commit"]
        pinned = {Path(f).name for f in loaded["module_files"] if commit in Path(f).parts}
        assert set(published["code_files"][key]) <= pinned


def test_offline_loading_from_cache_makes_no_request(hub, published, downloaded):
    hf_home, online = downloaded
    before = len(hub.requests)
    offline = run_client(LOAD, client_env(hub, hf_home, offline=True), load_payload(published))
    assert len(hub.requests) == before
    for key in ("llama", "llama_dev", "kvm", "kvm_dev", "maglev", "maglev_dev"):
        assert_close(offline[key + "_logits"], online[key + "_logits"], atol=0)
    assert offline["kvm_generated"] == online["kvm_generated"]
    assert offline["maglev_generated"] == online["maglev_generated"]


FINETUNE_AND_PUSH = r'''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# a user without our package: load KVM by repo id, train one step, publish the result
model = AutoModelForCausalLM.from_pretrained("test-org/kvm-tiny", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("test-org/kvm-tiny", trust_remote_code=True)
ids = torch.tensor(ARGS["prompt_ids"])
model.train()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
model.eval()
commit = model.push_to_hub("test-user/kvm-tiny-finetuned", commit_message="Fine-tune one step")
tokenizer.push_to_hub("test-user/kvm-tiny-finetuned")
with torch.no_grad():
    print(json.dumps({"commit": commit.oid, "logits": model(ids).logits.tolist()}))
'''

RELOAD_FINETUNED = r'''
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("test-user/kvm-tiny-finetuned", trust_remote_code=True)
with torch.no_grad():
    print(json.dumps({"logits": model(torch.tensor(ARGS["prompt_ids"])).logits.tolist()}))
'''


def test_model_push_to_hub_after_finetuning_reloads(hub, published, tmp_path):
    payload = {"prompt_ids": PROMPT_IDS}
    tuned = run_client(FINETUNE_AND_PUSH, client_env(hub, tmp_path / "tune"), payload)
    repo = hub.repo("test-user/kvm-tiny-finetuned")
    assert repo.resolve(tuned["commit"]).title == "Fine-tune one step"
    files = repo.resolve("main").files
    # the code travels along through transformers' own remote-code saving; the card carrier lives in the package
    # (the remote files hold no network code), so a remote-code-only user publishes transformers' own card
    assert "tokenizer.json" in files and set(published["code_files"]["kvm"]) <= set(files)
    card = repo.blobs[files["README.md"].git_oid].decode()
    assert "Saved again from" not in card
    reloaded = run_client(RELOAD_FINETUNED, client_env(hub, tmp_path / "reload"), payload)
    assert_close(reloaded["logits"], tuned["logits"])
    with pytest.raises(AssertionError):
        assert_close(reloaded["logits"], published["kvm_logits"])


RESUME = r"""
from huggingface_hub.errors import HfHubHTTPError
from kvm_maglev.hub import push_folder
try:
    push_folder(ARGS["folder"], "test-org/interrupted")
    first = "committed"
except HfHubHTTPError as error:
    first = str(error.response.status_code)
second = push_folder(ARGS["folder"], "test-org/interrupted")
third = push_folder(ARGS["folder"], "test-org/interrupted", private=True)  # same files, now private
print(json.dumps({"first": first, "second": second, "third": third}))
"""


def test_push_interrupted_at_commit_resumes_without_reuploading_then_goes_private(hub, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "kvm"}))
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    hub.failing_commits = 1
    before = len(hub.requests)
    result = run_client(RESUME, client_env(hub, tmp_path / "home"), {"folder": str(folder)}, block_package=False)
    assert result["first"] == "500"
    repo = hub.repo("test-org/interrupted")
    assert repo.resolve("main").oid == result["second"] == result["third"]
    assert repo.private  # --private on an existing public repo makes it private, without a commit
    assert [c.title for c in repo.commits.values()] == ["initial commit", "Upload kvm model from out"]
    uploads = [r for r in hub.requests[before:] if r[1] == "PUT" and r[2].startswith("/lfs-upload/")]
    assert len(uploads) == 1  # the weights stored before the failed commit are not sent again


def test_the_double_implemented_every_request_the_clients_made(hub, published, downloaded):
    assert hub.unrouted == [] and hub.crashes == []


# --- bad input: refused before anything is sent ---------------------------------------------------

SECRET = "hf_not_a_real_token_0123456789"


def converted_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "kvm"}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda f: (f / "config.json").unlink(), "has no config.json"),
        (lambda f: (f / "model.safetensors").unlink(), "conversion looks incomplete"),
        (
            lambda f: (f / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
            ),
            "model-00001-of-00002.safetensors",
        ),
        (lambda f: (f / "notes.txt").write_text(f"token={SECRET}"), "contains your Hugging Face token"),
    ],
)
def test_push_refuses_a_bad_folder(tmp_path, breakage, message):
    from kvm_maglev.hub import push_folder

    folder = converted_folder(tmp_path)
    breakage(folder)
    with pytest.raises(ValueError, match=message) as error:
        push_folder(folder, "test-org/model", token=SECRET)
    assert SECRET not in str(error.value)


TRAINING_STATE = ("optimizer.pt", "rng_state.pth", "scheduler.pt", "training_args.bin", "trainer_state.json")


def trainer_checkpoint(tmp_path: Path) -> Path:
    """What Trainer writes at a save step: the model folder plus its training state."""
    folder = converted_folder(tmp_path)
    for name in TRAINING_STATE:
        (folder / name).write_bytes(b"state")
    return folder


def test_push_refuses_training_state_unless_asked(tmp_path):
    from kvm_maglev.hub import push_folder

    with pytest.raises(ValueError, match="holds training state") as error:
        push_folder(trainer_checkpoint(tmp_path), "test-org/model", token=SECRET)
    assert all(name in str(error.value) for name in TRAINING_STATE) and "--include-training-state" in str(error.value)


PUSH_TRAINER_CHECKPOINT = """
import contextlib, io
import transformers.quantizers  # imports torchao where installed, whose CPU build prints at import: not captured
from kvm_maglev.cli import main
result = {}
for name, flags in (("refused", []), ("asked", ["--include-training-state"])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result[name] = [main(["push", ARGS["folder"], "test-org/trainer-checkpoint", *flags]), err.getvalue()]
print(json.dumps(result))
"""


def test_push_command_uploads_training_state_only_with_the_flag(hub, tmp_path):
    folder = trainer_checkpoint(tmp_path)
    before = len(hub.requests)
    result = run_client(PUSH_TRAINER_CHECKPOINT, client_env(hub, tmp_path / "home"), {"folder": str(folder)},
                        block_package=False)
    rc, err = result["refused"]
    assert rc == 2 and err.count("\n") == 1 and "optimizer.pt" in err
    assert result["asked"][0] == 0
    creates = [r for r in hub.requests[before:] if r[1:3] == ("POST", "/api/repos/create")]
    assert len(creates) == 1  # only the asked-for push reached the Hub
    assert set(TRAINING_STATE) <= set(hub.repo("test-org/trainer-checkpoint").resolve("main").files)


@pytest.mark.parametrize("config, message", [
    ({}, "not a model config"),
    ({"model_type": "rwkv7backbone"}, "convert it first with `kvm-maglev convert kvm"),
    ({"model_type": "not-a-model"}, "transformers has no model_type 'not-a-model'"),
])
def test_push_refuses_a_folder_that_would_not_load(tmp_path, config, message):
    from kvm_maglev.hub import push_folder

    folder = converted_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        push_folder(folder, "test-org/model", token=SECRET)


def test_push_accepts_remote_code_and_built_in_configs(tmp_path):
    from kvm_maglev.hub import _check_folder

    folder = converted_folder(tmp_path)
    for config in ({"model_type": "llama"}, {"model_type": "mine", "auto_map": {"AutoConfig": "c.C"}}):
        (folder / "config.json").write_text(json.dumps(config))
        assert _check_folder(folder) == folder


def test_push_builds_the_hub_folder_of_a_folder_without_code(tmp_path):
    """A kept demo model (config, weights, task) is pushed with the package's code; the folder is untouched."""
    import shutil

    from kvm_maglev import demo
    from kvm_maglev.convert.export import build_hub_folder, package_code_files
    from kvm_maglev.hub import _with_package_code
    from kvm_maglev.models.hub_code import hub_auto_map

    kept = shutil.copytree(demo.RECALL_MODELS_DIR / "kvm_fixed", tmp_path / "kvm_fixed")
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    with _with_package_code(kept) as upload:
        assert upload != kept
        for name, text in package_code_files("kvm").items():
            assert (upload / name).read_text() == text
        assert json.loads((upload / "config.json").read_text())["auto_map"] == hub_auto_map("kvm")
        assert (upload / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert not upload.exists() and [p.name for p in tmp_path.iterdir()] == ["kvm_fixed"]
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    complete = build_hub_folder(kept, tmp_path / "complete", progress=False)
    with _with_package_code(complete) as upload:
        assert upload == complete  # a folder with its code is pushed as it is


def test_push_refuses_a_missing_folder(tmp_path):
    from kvm_maglev.hub import push_folder

    with pytest.raises(ValueError, match="is not a folder"):
        push_folder(tmp_path / "missing", "test-org/model", token=SECRET)


@pytest.mark.parametrize("repo_id", ["model-only", "a/b/c", "org/", "/name", "org/na me", "org/..", "org/name.git"])
def test_push_refuses_a_bad_repo_id(tmp_path, repo_id):
    from kvm_maglev.hub import push_folder

    with pytest.raises(ValueError, match="repo"):
        push_folder(converted_folder(tmp_path), repo_id, token=SECRET)


def test_push_command_reports_errors_without_the_token(tmp_path, capsys, monkeypatch):
    import argparse

    from kvm_maglev import hub as push_command

    folder = converted_folder(tmp_path)
    (folder / "leak.json").write_text(json.dumps({"token": SECRET}))
    parser = argparse.ArgumentParser()
    push_command.add_arguments(parser)
    args = parser.parse_args([str(folder), "test-org/model", "--private"])
    monkeypatch.setenv("HF_TOKEN", SECRET)  # read when pushing, like `hf auth login`'s token
    assert push_command.run(args) == 2
    captured = capsys.readouterr()
    assert "leak.json contains your Hugging Face token" in captured.err
    assert SECRET not in captured.out + captured.err


def test_push_command_explains_missing_token_and_refusals(hub, tmp_path):
    code = """
    import argparse, contextlib, io, os
    from kvm_maglev import hub as push_command
    parser = argparse.ArgumentParser()
    push_command.add_arguments(parser)
    result = {}
    for name, repo_id, token in (("no_token", "test-org/model", None), ("forbidden", "someone-else/model", ARGS["token"])):
        if token:
            os.environ["HF_TOKEN"] = token
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = push_command.run(parser.parse_args([ARGS["folder"], repo_id]))
        result[name] = [rc, err.getvalue()]
    print(json.dumps(result))
    """
    env = client_env(hub, tmp_path / "home", token=False)
    before = len(hub.requests)
    result = run_client(code, env, {"folder": str(converted_folder(tmp_path)), "token": hub.token}, block_package=False)
    rc, err = result["no_token"]
    assert rc == 2 and "No Hugging Face token found: set HF_TOKEN" in err
    rc, err = result["forbidden"]
    assert rc == 1 and "the Hub refused the push to someone-else/model" in err and "403" in err
    assert hub.token not in err
    made = [r[1:4] for r in hub.requests[before:]]
    assert made[0] == ("POST", "/api/repos/create", 403) and not any("/commit/" in r[1] for r in made)


def test_repo_id_is_checked_while_parsing_arguments(capsys):
    import argparse

    from kvm_maglev.convert.common import add_push_arguments

    parser = argparse.ArgumentParser()
    add_push_arguments(parser)
    assert parser.parse_args(["--push-to-hub", "org/name", "--private"]).private
    with pytest.raises(SystemExit):
        parser.parse_args(["--push-to-hub", "no-namespace"])
    assert "repo id must look like ORG/NAME" in capsys.readouterr().err


def test_source_checkpoint_is_read_from_config_or_card(tmp_path):
    from kvm_maglev.hub import default_commit_message, find_source_checkpoint

    folder = converted_folder(tmp_path)
    assert find_source_checkpoint(folder) is None
    assert default_commit_message(folder) == "Upload kvm model from out"
    (folder / "README.md").write_text("# Card\n\nThe source code is in modeling_kvm.py.\n")
    assert find_source_checkpoint(folder) is None
    (folder / "README.md").write_text("| field | value |\n|---|---|\n| **source** | `ckpt/model_000011.pt` |\n")
    assert find_source_checkpoint(folder) == "ckpt/model_000011.pt"
    (folder / "README.md").write_text("Weights converted from `hf://org/run` with kvm-maglev.\n")
    assert find_source_checkpoint(folder) == "hf://org/run"
    assert default_commit_message(folder) == "Upload kvm model converted from hf://org/run"
    (folder / "README.md").write_text("# Card\n\n## Weights\n\n- source: `/runs/kvm/model_step000050.pt`\n- step: 50\n")
    assert default_commit_message(folder) == "Upload kvm model converted from model_step000050.pt"  # no local path
    (folder / "config.json").write_text(json.dumps({"model_type": "maglev", "source_checkpoint": "d2/model_000011.pt"}))
    assert default_commit_message(folder) == "Upload maglev model converted from model_000011.pt"


def test_card_is_published_with_the_repo_id_and_no_local_path(tmp_path):
    """A card converted earlier (local repo path, full source path) goes up naming the repo; the folder is untouched."""
    from kvm_maglev.hub import _upload_view

    folder = converted_folder(tmp_path)
    card = ('```python\nrepo = "out/kvm_final"\n```\n\n## Provenance\n\n'
            "- source: `/home/me/runs/kvm/model_step000050.pt`\n- training step: 50\n")
    (folder / "README.md").write_text(card)
    with _upload_view(folder, "test-org/kvm-tiny") as upload:
        assert upload != folder
        published = (upload / "README.md").read_text()
        assert (upload / "model.safetensors").read_bytes() == b"weights"
    assert 'repo = "test-org/kvm-tiny"' in published and "- source: `model_step000050.pt`" in published
    assert "/home/me" not in published and "out/kvm_final" not in published
    assert (folder / "README.md").read_text() == card and not upload.exists()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a card not of ours: as it is
    with _upload_view(folder, "test-org/kvm-tiny") as upload:
        assert upload == folder


# --- the double's HTTP contract, checked directly (what the client relies on) ---------------------


def _http(server: HubServer, method: str, path: str, body: bytes = b"", headers=None, token: bool = True):
    import http.client

    connection = http.client.HTTPConnection(server.endpoint.split("//")[1], timeout=10)
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {server.token}"
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), data


def test_double_resolve_headers_ranges_and_error_codes():
    import base64
    import hashlib

    with HubServer() as server:
        create = json.dumps({"name": "demo", "organization": "test-org", "private": False}).encode()
        assert _http(server, "POST", "/api/repos/create", create)[0] == 200
        assert _http(server, "POST", "/api/repos/create", create)[0] == 409
        content = b"0123456789" * 10
        commit = b"\n".join(
            json.dumps(line).encode()
            for line in (
                {"key": "header", "value": {"summary": "add data"}},
                {"key": "file", "value": {"path": "dir/data.txt", "content": base64.b64encode(content).decode(), "encoding": "base64"}},
            )
        )
        status, _, body = _http(server, "POST", "/api/models/test-org/demo/commit/main", commit, {"Content-Type": "application/x-ndjson"})
        oid = json.loads(body)["commitOid"]
        assert status == 200 and len(oid) == 40

        status, headers, body = _http(server, "HEAD", "/test-org/demo/resolve/main/dir/data.txt")
        git_oid = hashlib.sha1(b"blob 100\0" + content).hexdigest()
        assert (status, body) == (200, b"")
        assert headers["X-Repo-Commit"] == oid and headers["ETag"] == f'"{git_oid}"' and headers["Content-Length"] == "100"
        status, headers, body = _http(server, "GET", f"/test-org/demo/resolve/{oid}/dir/data.txt", headers={"Range": "bytes=95-"})
        assert (status, body, headers["Content-Range"]) == (206, b"56789", "bytes 95-99/100")
        assert _http(server, "GET", "/test-org/demo/resolve/main/dir/data.txt", headers={"Range": "bytes=200-"})[0] == 416

        status, headers, _ = _http(server, "HEAD", "/test-org/demo/resolve/main/missing.json")
        assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", oid)
        status, headers, _ = _http(server, "HEAD", "/test-org/demo/resolve/nope/dir/data.txt")
        assert (status, headers["X-Error-Code"]) == (404, "RevisionNotFound")
        status, headers, _ = _http(server, "HEAD", "/test-org/other/resolve/main/x")
        assert (status, headers["X-Error-Code"]) == (404, "RepoNotFound")

        tree = json.loads(_http(server, "GET", "/api/models/test-org/demo/tree/main?recursive=true")[2])
        assert [(item["type"], item["path"]) for item in tree] == [
            ("directory", "dir"), ("file", ".gitattributes"), ("file", "dir/data.txt")]
        info = json.loads(_http(server, "POST", "/api/models/test-org/demo/paths-info/main", b"paths=dir%2Fdata.txt&paths=nope&expand=true",
                                {"Content-Type": "application/x-www-form-urlencoded"})[2])
        assert [(i["path"], i["oid"], i["lastCommit"]["id"]) for i in info] == [("dir/data.txt", git_oid, oid)]

        assert _http(server, "POST", "/api/models/test-org/demo/tag/main", json.dumps({"tag": "v1"}).encode())[0] == 200
        assert _http(server, "POST", "/api/models/test-org/demo/tag/main", json.dumps({"tag": "v1"}).encode())[0] == 409
        refs = json.loads(_http(server, "GET", "/api/models/test-org/demo/refs")[2])
        assert refs["tags"] == [{"name": "v1", "ref": "refs/tags/v1", "targetCommit": oid}]
        assert json.loads(_http(server, "GET", "/api/models/test-org/demo/revision/v1")[2])["sha"] == oid

        assert _http(server, "POST", "/api/models/test-org/demo/commit/main", commit, token=False)[0] == 401
        assert json.loads(_http(server, "GET", "/api/whoami-v2")[2])["name"] == "test-user"
        assert _http(server, "GET", "/api/whoami-v2", token=False)[0] == 401
        history = json.loads(_http(server, "GET", "/api/models/test-org/demo/commits/main")[2])
        assert [c["title"] for c in history] == ["add data", "initial commit"] and history[0]["id"] == oid
        stale = commit.replace(b'"summary": "add data"', b'"summary": "again", "parentCommit": "' + b"0" * 40 + b'"')
        assert _http(server, "POST", "/api/models/test-org/demo/commit/main", stale)[0] == 412
        assert server.unrouted == [] and server.crashes == []


# --- converting straight from the Hub -------------------------------------------------------------

FROM_HUB = r"""
import contextlib, io
from huggingface_hub import HfApi
from kvm_maglev.cli import main

api = HfApi()
if ARGS["upload"]:
    for repo_id, folder in ARGS["repos"].items():
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=folder)
result = {}
for name, argv in ARGS["runs"].items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result[name] = [main(argv), err.getvalue()]
print(json.dumps(result))
"""


def kvm_authors_repo(data_dir: Path, folder: Path, marker: Path) -> Path:
    """The KVM authors' Hub layout: the final folder with auto_map into a bundled modeling_rwkv7_backbone.py."""
    import shutil

    shutil.copytree(data_dir / "kvm" / "kvm_fixed" / "research_final", folder, ignore=shutil.ignore_patterns("*.py"))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_rwkv7_backbone.Config",
                          "AutoModelForCausalLM": "modeling_rwkv7_backbone.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_rwkv7_backbone.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder


def nanochat_repo(data_dir: Path, folder: Path) -> Path:
    """A nanochat checkpoint shared on the Hub: model_<step>.pt, meta_<step>.json and tokenizer.pkl at the top."""
    import shutil

    nanochat = data_dir / "nanochat" / "tiny_sl"
    shutil.copytree(nanochat / "base_checkpoints" / "d2", folder)
    shutil.copy(nanochat / "tokenizer" / "tokenizer.pkl", folder / "tokenizer.pkl")
    return folder


def test_convert_straight_from_a_hub_repo(hub, tmp_path, data_dir):
    from safetensors.torch import load_file

    from kvm_maglev.cli import main

    marker, out, hf_home = tmp_path / "code_ran", tmp_path / "out", tmp_path / "home"
    repos = {"test-org/kvm-research": str(kvm_authors_repo(data_dir, tmp_path / "kvm_repo", marker)),
             "test-user/nanochat-d2": str(nanochat_repo(data_dir, tmp_path / "nano_repo"))}
    runs = {"kvm": ["convert", "kvm", "test-org/kvm-research", str(out / "kvm"), "--revision", "main"],
            "maglev": ["convert", "maglev", "test-user/nanochat-d2", str(out / "maglev")],
            "step10": ["convert", "maglev", "test-user/nanochat-d2", str(out / "step10"), "--step", "10"],
            "wrong_kind": ["convert", "maglev", "test-org/kvm-research", str(out / "wrong")],
            "no_repo": ["convert", "kvm", "nobody/nothing", str(out / "none")],
            "no_revision": ["convert", "kvm", "test-org/kvm-research", str(out / "none"), "--revision", "v9"]}
    env = client_env(hub, hf_home)
    result = run_client(FROM_HUB, env, {"upload": True, "repos": repos, "runs": runs}, block_package=False)
    assert [result[name][0] for name in ("kvm", "maglev", "step10")] == [0, 0, 0], result
    assert "test-org/kvm-research is a KVM research save_pretrained folder" in result["wrong_kind"][1]
    assert "the Hub has no model repo nobody/nothing" in result["no_repo"][1]
    assert "has no revision 'v9'" in result["no_revision"][1]
    for name in ("wrong_kind", "no_repo", "no_revision"):
        assert result[name][0] == 2 and result[name][1].count("error:") == 1 and "Traceback" not in result[name][1]
    assert not marker.exists() and not list(hf_home.rglob("*.py"))  # the repo's code was never fetched nor run

    before = len(hub.requests)  # offline: the same conversion again, from the cache alone
    offline = run_client(FROM_HUB, client_env(hub, hf_home, offline=True),
                         {"upload": False, "runs": {"maglev": runs["maglev"][:-1] + [str(out / "offline")]}},
                         block_package=False)
    assert offline["maglev"][0] == 0 and len(hub.requests) == before

    local = tmp_path / "local"
    assert main(["convert", "kvm", repos["test-org/kvm-research"], str(local / "kvm")]) == 0
    assert main(["convert", "maglev", repos["test-user/nanochat-d2"], str(local / "maglev")]) == 0
    for name, repo_id, source_file in (("kvm", "test-org/kvm-research", "model.safetensors"),
                                       ("maglev", "test-user/nanochat-d2", "model_000011.pt")):
        ours, theirs = load_file(out / name / "model.safetensors"), load_file(local / name / "model.safetensors")
        assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
        card = (out / name / "README.md").read_text()
        assert f"base_model:\n- {repo_id}\n" in card
        commit = hub.repo(repo_id).resolve("main").oid
        assert f"- source: `hf://{repo_id}@{commit}/{source_file}`" in card
    assert "training step: 10" in (out / "step10" / "README.md").read_text()
    assert (out / "maglev" / "tokenizer.json").is_file()
    assert load_file(out / "offline" / "model.safetensors").keys() == load_file(out / "maglev" / "model.safetensors").keys()
