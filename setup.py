"""turbomoe: fused MoE gating kernels with hand-written backward passes, for PyTorch."""
from setuptools import find_packages, setup

EXTRAS = {
    "deepspeed": ["deepspeed==0.19.8"],
    "megatron": ["megatron-core==0.16.1"],
    "train": ["deepspeed==0.19.8", "pyyaml", "tqdm", "wandb"],
    # Hugging Face directories (turbomoe.models.hf_checkpoint, python -m turbomoe.export): safetensors
    # shards, the byte tokenizer's tokenizer.json; tqdm for the export's progress bar.
    "export": ["safetensors", "tokenizers", "tqdm"],
    # transformers' own MoE models on turbomoe (turbomoe.integrations.transformers), and the tests that
    # load exported models with it.
    "transformers": ["transformers>=5"],
    "bench": ["matplotlib"],
    # the recipes' Parquet corpora and zstandard-compressed JSON lines (turbomoe.data.corpus)
    "data": ["pyarrow", "zstandard"],
    # CUTLASS's C++ headers for the Hopper grouped GEMM (built on first use; torch._grouped_mm without).
    "cuda": ["nvidia-cutlass==4.2.0.0"],
}
# Everything the test suite touches: the integrations, the recipes, Megatron's indexed datasets, the
# compressed and Parquet corpora, and transformers (>= 5): the model's forward is checked against
# Hugging Face's Qwen3-MoE, exported models are loaded with it, and its models run on turbomoe's
# experts. pytest-xdist runs the interpreted Triton tests a process per core (scripts/test.sh).
EXTRAS["dev"] = sorted({"pytest", "pytest-xdist", "numpy", *EXTRAS["train"], *EXTRAS["megatron"], *EXTRAS["export"],
                        *EXTRAS["transformers"], *EXTRAS["data"]})

setup(
    name="turbomoe",
    version="0.1.0",
    description="Training-first Mixture-of-Experts kernels and layers for PyTorch",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["turbomoe", "turbomoe.*"]),
    python_requires=">=3.10",
    # The CUDA backend's sources, compiled on first use (turbomoe/csrc/__init__.py).
    package_data={"turbomoe.csrc": ["*.cpp", "*.cu", "*.cuh"]},
    # torch is pinned by the user's environment (CPU or CUDA build); any 2.4+ works. ninja builds
    # the CUDA backend (torch.utils.cpp_extension needs it).
    install_requires=["torch>=2.4", "triton>=3.0", "numpy", "ninja"],
    extras_require=EXTRAS,
)
