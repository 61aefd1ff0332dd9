"""Builds specdec_ops._C (op schemas and CPU kernels) from csrc/.

CUDA kernels are Triton, compiled at run time, so the extension itself is a
plain C++ build: `pip install --no-build-isolation -e .` works on CPU-only and
GPU machines alike.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
# No -std flag: torch's build helper picks the standard its headers need (C++17 vs C++20 changes layouts that
# exceptions cross). -g0 drops the debug information Python's default flags ask for, which costs about a quarter of
# the compile time of each unit and makes the objects 40 times larger. scripts/time_build.py compiles with these.
CXX_FLAGS = ["-O3", "-g0"]

setup(
    name="specdec_ops",
    version="0.1.0",
    description="Speculative-decoding building blocks as PyTorch custom ops",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["specdec_ops", "specdec_ops.*"]),
    ext_modules=[
        CppExtension(
            "specdec_ops._C",
            sources,
            extra_compile_args={"cxx": CXX_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={"cuda": ["triton>=3.6"], "test": ["pytest", "numpy", "scipy"]},
    entry_points={"console_scripts": ["specdec-generate = specdec_ops.generate:main"]},
)
