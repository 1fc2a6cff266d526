from setuptools import find_packages, setup

setup(
    name="mindspeed_rl",
    version="0.1.0",
    description="Hybrid actor engine for GRPO post-training: Megatron-core trains, vLLM generates, on the same devices.",
    packages=find_packages(include=["mindspeed_rl", "mindspeed_rl.*"]),
    python_requires=">=3.10",
)
