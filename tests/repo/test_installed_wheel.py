"""The engine as a user installs it: a wheel whose only top-level package is `core_engine`, so
that it installs beside proto-plus (whose top-level package is `proto`, as the engine's own
`proto` folder is) without either overwriting the other, and serves from there."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import proto  # proto-plus's, installed in the base environment
from core_engine.frontend import LLM
from core_engine.proto import SamplingParams
import core_engine.frontend

assert hasattr(proto, "Message"), proto.__file__
assert core_engine.frontend.__file__.startswith(sys.prefix), core_engine.frontend.__file__
with LLM(model="null", max_model_len=64) as llm:
    (output,) = llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)
print(output.outputs[0].token_ids)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_installs_beside_proto_plus_and_serves(tmp_path):
    wheel_dir = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(wheel_dir), str(REPO_ROOT)], check=True, timeout=300)
    (wheel,) = wheel_dir.glob("core_engine-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"core_engine"}

    # A virtual environment that sees the base one's packages (torch, proto-plus, ...) but has
    # the engine from the wheel, which it finds before the base one's editable install.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, timeout=300)
    result = subprocess.run(
        [str(python), "-P", "-c", PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[42, 42, 42]"
