from setuptools import setup

# The Triton kernels live in the top-level folder kernels/ (the architecture at a
# glance) but ship as eagle_capture.kernels: a top-level import name "kernels"
# would collide with Hugging Face's "kernels" package on PyPI. The symlink
# eagle_capture/kernels -> ../kernels makes the same import work from a source
# checkout, an editable install and a wheel alike (setuptools' package_dir
# mapping of a subpackage breaks its editable finder).
setup(
    name="eagle-capture",
    version="0.1.0",
    description="Fused EAGLE-3 aux-hidden-state capture kernels and torch.library ops",
    python_requires=">=3.10",
    packages=["eagle_capture", "eagle_capture.kernels"],
    install_requires=["torch>=2.6", "triton>=3.2"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "numpy", "transformers>=4.57"],
        "bench": ["nvidia-ml-py>=12", "matplotlib>=3.7", "tqdm>=4.60", "numpy"],
    },
)
