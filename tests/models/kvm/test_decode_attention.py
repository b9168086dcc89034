"""KVM's decoding attention over state and window read in place (decode_attention_kvm): the torch path against the
model's `joint_attention`, the Triton kernel (speedups/decode_kernel_kvm, under Triton's CPU interpreter) against the
torch path, and the torch path under torch.compile(fullgraph=True) against eager."""

import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvm_maglev
from kvm_maglev.models.kvm import decode_attention_kvm
from kvm_maglev.models.kvm.decode_attention_kvm import decoding_attention, state_window_attention_torch
from kvm_maglev.models.kvm.modeling_kvm import KeySet, joint_attention

REPO = Path(__file__).resolve().parents[3]


def decode_inputs(groups: int, dtype: torch.dtype, temperatures: bool, seed: int = 0, kv_heads: int = 2,
                  dim: int = 8, value_dim: int = 8, capacity: int = 20, ring: int = 24) -> dict:
    """Random inputs of the decoding attention (`state_window_attention_torch`'s arguments) for 4 rows on a pool of
    6 pages, rows on shuffled pages (as a serving engine places them): row 0 has no state yet, row 1 a full state,
    the others part of it; each row sees a random part of its ring and always its newest slot."""
    generator = torch.Generator().manual_seed(seed)
    rows, pages, heads = 4, 6, kv_heads * groups

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    visible = torch.rand(rows, ring, generator=generator) < 0.6
    visible[torch.arange(rows), torch.randint(ring, (rows,), generator=generator)] = True
    return dict(
        q=normal(rows, heads, dim), page=torch.tensor([3, 0, 5, 1]),
        state_keys=normal(pages, kv_heads, capacity, dim), state_values=normal(pages, kv_heads, capacity, value_dim),
        state_slots=torch.tensor([0, capacity, 7, capacity - 3]),
        window_keys=normal(pages, kv_heads, ring, dim), window_values=normal(pages, kv_heads, ring, value_dim),
        window_visible=visible,
        state_temperature=torch.rand(heads, generator=generator) + 0.5 if temperatures else None,
        window_temperature=torch.rand(heads, generator=generator) + 0.5 if temperatures else None,
        scale=1.0 / math.sqrt(dim))


def model_attention(inputs: dict) -> torch.Tensor:
    """The same attention through modeling_kvm's `joint_attention`: one query per piece, a state and a window key
    set gathered from each row's page."""
    page, capacity = inputs["page"], inputs["state_keys"].shape[2]
    live = torch.arange(capacity) < inputs["state_slots"][:, None]
    key_sets = [KeySet(inputs["state_keys"][page], inputs["state_values"][page], live[:, None],
                       inputs["state_temperature"]),
                KeySet(inputs["window_keys"][page], inputs["window_values"][page], inputs["window_visible"][:, None],
                       inputs["window_temperature"])]
    groups = inputs["q"].shape[1] // inputs["state_keys"].shape[1]
    return joint_attention(inputs["q"][:, None], key_sets, groups, inputs["scale"])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperatures", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_torch_path_equals_joint_attention(groups, temperatures, dtype):
    inputs = decode_inputs(groups, dtype, temperatures, seed=groups)
    out = state_window_attention_torch(**inputs)
    assert out.dtype == dtype and out.shape == (4, 2 * groups, 8)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, model_attention(inputs), **tolerance)


def test_rows_without_state_read_only_their_window():
    """A row with no state slot yet gets the softmax over its visible ring slots alone, whatever its state page
    holds."""
    inputs = decode_inputs(2, torch.float32, temperatures=True)
    out = state_window_attention_torch(**inputs)
    inputs["state_keys"][inputs["page"][0]] = 1e4
    torch.testing.assert_close(state_window_attention_torch(**inputs)[0], out[0])


def test_dispatch_takes_the_torch_path_off_cuda():
    """On CPU the visible dispatch chooses the torch path (the kernel's seam found it where Triton imports, and it
    refuses CPU tensors), and computes what it computes."""
    inputs = decode_inputs(2, torch.float32, temperatures=True)
    storage = [inputs[name] for name in ("state_keys", "state_values", "window_keys", "window_values")]
    kernel = decode_attention_kvm.decode_kernel_kvm
    assert (kernel is None) == (importlib.util.find_spec("triton") is None)
    assert kernel is None or not kernel.use_triton_kernel(inputs["q"], *storage)
    assert decoding_attention(inputs["q"], *storage) is state_window_attention_torch


def test_compiled_torch_path_equals_eager():
    """The torch path traces whole (no host sync, no data-dependent branch) and computes what eager does."""
    compiled = torch.compile(state_window_attention_torch, fullgraph=True)
    for temperatures in (False, True):
        inputs = decode_inputs(2, torch.float32, temperatures, seed=3)
        torch.testing.assert_close(compiled(**inputs), state_window_attention_torch(**inputs), rtol=1e-5, atol=1e-5)


def interpreter_check() -> None:
    """Run in a process started with TRITON_INTERPRET=1 (Triton reads it when the kernel is defined, at the
    module's import): the kernel on CPU tensors against the torch path, over grouped heads (also a group of 3,
    padded inside the kernel), odd head dims, both dtypes, with and without temperatures, and storage that is a
    strided view of a larger pool (as pages are)."""
    from kvm_maglev.models.speedups.decode_kernel_kvm import state_window_attention_triton

    cases = [dict(groups=1, dtype=torch.float32, temperatures=False),
             dict(groups=2, dtype=torch.float32, temperatures=True),
             dict(groups=3, dtype=torch.float32, temperatures=True, dim=12, value_dim=6, ring=9),
             dict(groups=2, dtype=torch.bfloat16, temperatures=True),
             dict(groups=1, dtype=torch.float32, temperatures=True, capacity=150, ring=140)]  # 2 blocks of 128 keys
    for seed, case in enumerate(cases):
        inputs = decode_inputs(seed=seed, **case)
        if case.get("ring") == 140:  # row 0, without state, sees nothing in the ring's first block
            inputs["window_visible"][0, :128] = False
            inputs["window_visible"][0, 130] = True
        expected = state_window_attention_torch(**inputs)
        tolerance = dict(rtol=1e-5, atol=1e-5) if case["dtype"] == torch.float32 else {}
        torch.testing.assert_close(state_window_attention_triton(**inputs), expected, **tolerance)
        # the state inside a wider pool (capacity and a head dim padded): strided, read in place
        for name in ("state_keys", "state_values"):
            pool = torch.zeros(*inputs[name].shape[:2], inputs[name].shape[2] + 5, inputs[name].shape[3] + 3,
                               dtype=inputs[name].dtype)
            pool[:, :, :inputs[name].shape[2], :inputs[name].shape[3]] = inputs[name]
            inputs[name] = pool[:, :, :inputs[name].shape[2], :inputs[name].shape[3]]
        torch.testing.assert_close(state_window_attention_triton(**inputs), expected, **tolerance)
    print("interpreted kernel equals the torch path")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (pip install triton): its CPU interpreter runs the kernel here")
def test_triton_kernel_in_interpreter_equals_torch_path():
    """The Triton kernel under Triton's CPU interpreter, in a fresh process so that TRITON_INTERPRET=1 is set before
    Triton defines the kernel, whatever this process imported before."""
    source = str(Path(kvm_maglev.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [source, str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-c", "from tests.models.kvm.test_decode_attention import interpreter_check; "
                                     "interpreter_check()"]
    began = time.monotonic()
    run = subprocess.run(command, cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "interpreted kernel equals the torch path" in run.stdout
    print(f"interpreter check: {time.monotonic() - began:.1f} s")


# the kernel's pointer arguments by element type: the storage's, the indices', the mask's bytes, the temperatures'
KERNEL_POINTERS = dict(q_ptr=None, state_keys_ptr=None, state_values_ptr=None, window_keys_ptr=None,
                       window_values_ptr=None, out_ptr=None, page_ptr="i64", slots_ptr="i64", visible_ptr="u8",
                       state_temperature_ptr="fp32", window_temperature_ptr="fp32")


def kernel_argument_type(name: str, element: str, constexprs: dict) -> str:
    """The type Triton's compiler takes for one kernel argument: a pointer, a compile-time constant, the float
    scale, or an int32 (sizes and strides)."""
    if name in KERNEL_POINTERS:
        return "*" + (KERNEL_POINTERS[name] or element)
    if name in constexprs:
        return "constexpr"
    return "fp32" if name == "scale_log2e" else "i32"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)")
@pytest.mark.parametrize("element, groups, dim", [("bf16", 4, 128), ("fp32", 3, 12)])
def test_triton_kernel_compiles_for_a_gpu(element, groups, dim):
    """Triton's compiler (not its interpreter, which checks less: types, layouts) lowers the kernel to an sm_90 binary
    on this machine without a GPU, with the key block `state_window_attention_triton` would take."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvm_maglev.models.speedups.decode_kernel_kvm import _state_window_kernel, key_block

    if not isinstance(_state_window_kernel, triton.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: the kernel is defined for the interpreter")
    constexprs = dict(GROUPS=groups, DIM=dim, VALUE_DIM=dim, STATE_TEMPERATURE=True, WINDOW_TEMPERATURE=False,
                      BLOCK_GROUPS=triton.next_power_of_2(groups), BLOCK_DIM=triton.next_power_of_2(dim),
                      BLOCK_VALUE_DIM=triton.next_power_of_2(dim), BLOCK_KEYS=key_block(groups, dim, dim))
    signature = {name: kernel_argument_type(name, element, constexprs) for name in _state_window_kernel.arg_names}
    compiled = triton.compile(ASTSource(_state_window_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
