import re
from pathlib import Path

import setuptools
from setuptools import setup

HERE = Path(__file__).resolve().parent
URL = "https://github.com/eagle-capture/eagle-capture"
# One version, eagle_capture.__version__ (what `eagle-capture --version` prints), read as
# text: importing the package here would need it importable before it is installed.
VERSION = re.search(
    r'^__version__ = "([^"]+)"$',
    (HERE / "eagle_capture" / "__init__.py").read_text(encoding="utf-8"),
    re.M,
).group(1)

# License-Expression (PEP 639) from setuptools 77 on; older setuptools (an
# offline --no-build-isolation install uses whatever is there) has only the
# free-text License field.
if int(setuptools.__version__.split(".")[0]) >= 77:
    LICENSE = {"license_expression": "Apache-2.0"}
else:
    LICENSE = {"license": "Apache-2.0"}

# The Triton kernels live in eagle_capture/kernels/: no top-level "kernels" folder,
# which a checkout or an editable install would put on sys.path ahead of Hugging
# Face's "kernels" package (a dependency of transformers >= 5.25).
setup(
    name="eagle-capture",
    version=VERSION,
    description="Fused EAGLE-3 aux-hidden-state capture kernels and torch.library ops",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    url=URL,
    project_urls={
        "Source": URL,
        "Issues": f"{URL}/issues",
    },
    # No license classifier: setuptools refuses one next to a License-Expression.
    **LICENSE,
    license_files=["LICENSE"],
    python_requires=">=3.10",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Environment :: GPU :: NVIDIA CUDA",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    keywords=["eagle-3", "speculative-decoding", "triton", "torch.compile", "sglang", "vllm"],
    # Found, not listed: a hand-kept list once dropped integrations/sglang/families/
    # from every wheel (tests/test_packaging.py installs a built wheel and imports it all).
    packages=setuptools.find_packages(include=["eagle_capture", "eagle_capture.*"]),
    # Data files inside packages (the probe's calibration prompts, the doctor's engine
    # facts); MANIFEST.in puts the same files in the sdist.
    package_data={"": ["*.jsonl"], "eagle_capture.layer_ids": ["data/*.json"]},
    # SGLang's plugin system (0.5.13+) finds the fused capture here in every
    # scheduler process; EAGLE_CAPTURE=1 turns it on (eagle_capture/integrations/sglang/plugin.py).
    entry_points={
        "sglang.srt.plugins": ["eagle_capture = eagle_capture.integrations.sglang.plugin:register"],
        # vLLM's load_general_plugins() runs it in every process (eagle_capture/integrations/vllm/plugin.py)
        "vllm.general_plugins": ["eagle_capture = eagle_capture.integrations.vllm.plugin:register"],
        # eagle-capture doctor | probe ... (eagle_capture/cli/__init__.py)
        "console_scripts": ["eagle-capture = eagle_capture.cli:console_main"],
    },
    install_requires=["torch>=2.6", "triton>=3.2"],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "numpy",
            "transformers>=4.57",
            "tomli>=1.1; python_version < '3.11'",
        ],
        # the lint of .ci/run and .pre-commit-config.yaml (pyproject.toml [tool.ruff])
        "lint": ["ruff==0.17.6"],
        # eagle-capture probe runs the target as a Hugging Face model
        "probe": ["transformers>=4.57", "safetensors", "tqdm>=4.60"],
        "bench": ["nvidia-ml-py>=12", "matplotlib>=3.7", "tqdm>=4.60", "numpy"],
    },
)
