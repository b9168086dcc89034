"""Two processes on CPU (gloo) against one: FSDP2 training and tensor-parallel inference, both models.

docs/distributed.md says which paths run where and why the others are refused on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.ecosystem import ecosystem_support as support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# transformers' own FSDP2 (sharded at from_pretrained, trained by Trainer) arrived after 5.17
LOAD_TIME_FSDP = hasattr(PreTrainedModel, "is_distributed_loading_by_transformers")
CPU_FSDP_REFUSED = ("accelerate applies Trainer's `fsdp` options only on accelerators: on CPU it runs the "
                    "processes as DistributedType.MULTI_CPU and drops the FSDP plugin (no error, no sharding)")


@pytest.fixture(scope="module", params=sorted(support.MODEL_BUILDERS))
def model_dir(request, tmp_path_factory):
    return support.model_folder(request.param, tmp_path_factory.getbasetemp())


def run(command: list[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, env=env or ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def torchrun(script: str, *args: str) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / script), *args])


def logits_of(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_no_split_modules_are_the_decoder_blocks(model_dir):
    """FSDP's wrap unit and device_map's smallest piece: every block of the decoder (and of Maglev's prefiller)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    blocks = [module for name, module in model.named_modules() if name.count(".") == 2
              and name.split(".")[1] in ("layers", "prefiller_layers")]
    assert blocks and {type(block).__name__ for block in blocks} == set(model._no_split_modules)


@pytest.mark.skipif(not LOAD_TIME_FSDP, reason="this transformers has no FSDP2 at from_pretrained for Trainer")
def test_fsdp2_training_matches_one_process(model_dir, tmp_path):
    """5 Trainer steps sharded over 2 processes (transformers' FSDP2, one unit per block): the losses of one
    process within 1e-5, and the gathered weights, saved and read back with from_pretrained, its logits."""
    block = str(support.training_block_size(model_dir))
    run([sys.executable, str(HERE / "fsdp_worker.py"), str(model_dir), str(tmp_path / "one"), block])
    torchrun("fsdp_worker.py", str(model_dir), str(tmp_path / "two"), block)
    one, two = (json.loads((tmp_path / run_name / "losses.json").read_text()) for run_name in ("one", "two"))
    assert two["world_size"] == 2 and len(one["losses"]) == len(two["losses"]) == 5
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-5, (one, two)
    ids = torch.arange(5, 5 + int(block)).unsqueeze(0)
    torch.testing.assert_close(logits_of(tmp_path / "two" / "final", ids), logits_of(tmp_path / "one" / "final", ids),
                               atol=1e-4, rtol=1e-4)


def finetune(model_dir: Path, out: Path, processes: int, *extra: str) -> list[float]:
    """examples/finetune.py for 5 steps of 4 blocks on `processes` processes; the logged losses."""
    script = str(support.REPO_ROOT / "examples" / "finetune.py")
    args = ["--model", str(model_dir), "--output-dir", str(out), "--block-size",
            str(support.training_block_size(model_dir)), "--max-steps", "5", "--batch-size", str(4 // processes),
            "--logging-steps", "1", "--save-steps", "3", "--eval-fraction", "0", *extra]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    run(launch + [script] + args if processes > 1 else [sys.executable, script] + args)
    history = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=CPU_FSDP_REFUSED)
def test_fsdp_through_trainer_options_saves_resumes_and_reloads(model_dir, tmp_path):
    """`finetune.py --fsdp` (Trainer's fsdp options, accelerate's FSDP2) on 2 GPUs: the losses of one process,
    sharded checkpoints, a resume from one that continues with the same losses, a whole final model."""
    one = finetune(model_dir, tmp_path / "one", 1)
    two = finetune(model_dir, tmp_path / "two", 2, "--fsdp")
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    assert any(path.name.startswith("pytorch_model_fsdp") for path in (tmp_path / "two" / "checkpoint-3").iterdir())
    resumed = finetune(model_dir, tmp_path / "two", 2, "--fsdp", "--resume", str(tmp_path / "two" / "checkpoint-3"))
    assert max(abs(a - b) for a, b in zip(two, resumed)) < 1e-5, (two, resumed)
    ids = torch.arange(5, 5 + support.training_block_size(model_dir)).unsqueeze(0)
    torch.testing.assert_close(logits_of(tmp_path / "two", ids), logits_of(tmp_path / "one", ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero3_saves_resumes_and_reloads(tmp_path, tmp_path_factory):
    """`finetune.py --deepspeed examples/deepspeed_zero3.json` on 2 CPU processes: the losses of one process
    within 1e-5, weights and optimizer state sharded per rank in the checkpoint, a resume from it with the same
    losses, and a whole final model that from_pretrained reads with the one-process logits. KVM only: the
    engine treats both models alike (both pass by hand), and each run costs a minute here."""
    model_dir = support.model_folder("kvm", tmp_path_factory.getbasetemp())
    config = str(support.REPO_ROOT / "examples" / "deepspeed_zero3.json")
    one = finetune(model_dir, tmp_path / "one", 1)
    two = finetune(model_dir, tmp_path / "two", 2, "--deepspeed", config)
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    shards = {path.name for path in (tmp_path / "two" / "checkpoint-3" / "global_step3").iterdir()}
    assert {f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in (0, 1)} <= shards, shards
    resumed = finetune(model_dir, tmp_path / "resumed", 2, "--deepspeed", config,
                       "--resume", str(tmp_path / "two" / "checkpoint-3"))
    assert max(abs(a - b) for a, b in zip(two, resumed)) < 1e-5, (two, resumed)
    ids = torch.arange(5, 5 + support.training_block_size(model_dir)).unsqueeze(0)
    torch.testing.assert_close(logits_of(tmp_path / "resumed", ids), logits_of(tmp_path / "one", ids),
                               atol=1e-4, rtol=1e-4)


def test_tensor_parallel_inference_matches_one_process(model_dir, tmp_path):
    """`from_pretrained(tp_plan="auto")` on 2 processes shards attention by head (KVM's per-head state
    parameters and Maglev's memory projections with them) and the MLP: same logits and greedy generations
    as the whole model, over prompts long enough for KVM's state and Maglev's memory to act."""
    report_path = tmp_path / "tp.json"
    torchrun("tensor_parallel_worker.py", str(model_dir), str(report_path), "80", "24")
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2
    assert report["logits_max_abs_diff"] < 1e-4 and report["same_generations"], report
    sharded = {name.split(".", 3)[-1] for name in report["sharded"] if ".layers.1." in name}
    expected = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] == "kvm":  # layer 1 is a KVM layer: its state's per-head parameters follow the heads
        expected |= {"self_attn.merge_gate_proj.weight", "self_attn.state_temperature", "self_attn.q_shift"}
    else:
        expected |= {"self_attn.memory_k_proj.weight", "self_attn.memory_v_proj.weight", "self_attn.memory_gate.weight"}
    assert expected <= sharded, expected - sharded


def multi_query_research_checkpoint(folder: Path) -> tuple[Path, Path]:
    """The upstream GQA fixture cut to its first key/value head (4 query heads on 1): a research checkpoint
    whose single key/value head 2 tensor-parallel ranks cannot share."""
    research = support.REPO_ROOT / "tests" / "data" / "kvm_upstream" / "kvm_gqa_fixed" / "research"
    checkpoint = torch.load(research / "model_step000050.pt", weights_only=True)
    per_kv_head = {"attn.c_k.weight": (0, 16), "attn.c_v.weight": (0, 16), "attn.x_k": (0, 16),
                   "attn.x_v": (0, 16), "attn.v_gate0": (2, 16), "attn.v_gate2.weight": (0, 16),
                   "attn.key_weighting.weight": (0, 1)}
    for key, value in checkpoint["model"].items():
        for name, (dim, width) in per_kv_head.items():
            if key.endswith(name):
                checkpoint["model"][key] = value.narrow(dim, 0, width).clone()
    folder.mkdir(parents=True)
    torch.save(checkpoint, folder / "model_step000050.pt")
    config = (research / "config.yaml").read_text().replace("num_key_value_heads: 2", "num_key_value_heads: 1")
    (folder / "config.yaml").write_text(config)
    return folder / "model_step000050.pt", folder / "config.yaml"


def test_tensor_parallel_gqa_keeps_key_value_heads_with_their_query_heads(tmp_path):
    """2 ranks on 2 key/value heads: each keeps one key/value head's state with its 2 query heads, same logits
    and generations as the whole model; on 1 key/value head the sharded model is refused by name."""
    from kvm_maglev.convert.kvm import convert

    grouped = convert(support.REPO_ROOT / "tests" / "data" / "kvm_upstream" / "kvm_gqa_fixed" / "research_final",
                      tmp_path / "gqa")
    torchrun("tensor_parallel_worker.py", str(grouped), str(tmp_path / "tp.json"), "80", "8")
    report = json.loads((tmp_path / "tp.json").read_text())
    assert report["logits_max_abs_diff"] < 1e-4 and report["same_generations"], report
    assert report["sharded"]["model.layers.1.self_attn.merge_gate_proj.weight"] == [1, 64]
    assert report["sharded"]["model.layers.1.self_attn.k_proj.weight"] == [16, 64]
    checkpoint, config = multi_query_research_checkpoint(tmp_path / "mqa_research")
    single = convert(checkpoint, tmp_path / "mqa", config_path=config)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(HERE / "tensor_parallel_worker.py"), str(single), str(tmp_path / "mqa.json"), "80", "8"],
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "tensor parallel size 2 does not divide num_key_value_heads=1" in result.stderr, result.stderr[-3000:]
