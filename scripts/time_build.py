"""Times the C++ build one translation unit at a time, with the flags setup.py's build uses.

    python scripts/time_build.py [--jobs 1] [csrc/x.cpp ...]

Each csrc/*.cpp is compiled to an object file in a temporary folder (nothing in the tree is written), with the
flags of the real build (Python's CFLAGS, as setuptools passes them, then setup.py's CXX_FLAGS), and its wall time
printed, then the total. Compiling one unit at a time shows where the time goes; the build itself runs
units in parallel (ninja), so its wall time on N cores is about the total over N, bounded below by the slowest
unit.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
from torch.utils import cpp_extension


def setup_cxx_flags(root: str) -> list[str]:
    """The CXX_FLAGS list of setup.py (read, not imported: importing setup.py would run setup())."""
    text = open(os.path.join(root, "setup.py")).read()
    return ast.literal_eval(re.search(r"^CXX_FLAGS = (\[.*?\])", text, re.M).group(1))


def compile_command(source: str, obj: str, extra: list[str]) -> list[str]:
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["c++", *shlex.split(sysconfig.get_config_var("CFLAGS") or ""), "-fPIC",
            *(f"-I{path}" for path in includes), "-c", source, "-o", obj, *extra,
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-std=c++20"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", help="translation units (default: csrc/*.cpp)")
    parser.add_argument("--flags", help="the flags after Python's CFLAGS (default: setup.py's CXX_FLAGS)")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    extra = shlex.split(args.flags) if args.flags is not None else setup_cxx_flags(root)
    sources = args.sources or sorted(glob.glob(os.path.join(root, "csrc", "*.cpp")))
    total = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            start = time.perf_counter()
            result = subprocess.run(compile_command(source, os.path.join(tmp, "unit.o"), extra), capture_output=True,
                                    text=True)
            seconds = time.perf_counter() - start
            if result.returncode != 0:
                sys.exit(f"{source} failed:\n{result.stderr[-3000:]}")
            total += seconds
            print(f"{os.path.relpath(source, root):28s} {seconds:6.1f} s", flush=True)
    print(f"{'total (one unit at a time)':28s} {total:6.1f} s")


if __name__ == "__main__":
    main()
