"""The installed package: version, public names, type marker, interpreter choice on CPU."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import safemoe

PUBLIC = {
    "route", "experts", "moe", "Routing", "new_health_tensor", "HEALTH_SLOTS", "__version__",
    "MoE", "Workspace", "workspace_bytes", "CUDAGraphRunner", "zero_padding_", "Health",
}


def _installed() -> bool:
    try:
        importlib.metadata.distribution("safemoe")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# The GPU machine runs the suite from the source tree (PYTHONPATH=src), with no installed metadata.
needs_install = pytest.mark.skipif(not _installed(), reason="run from the source tree, not installed")


def test_version() -> None:
    assert isinstance(safemoe.__version__, str)
    parts = safemoe.__version__.split(".")
    assert len(parts) >= 3 and all(p.isdigit() for p in parts[:2])


@needs_install
def test_installed_version_matches() -> None:
    assert importlib.metadata.version("safemoe") == safemoe.__version__


def test_public_names() -> None:
    assert set(safemoe.__all__) >= PUBLIC
    for name in safemoe.__all__:
        assert hasattr(safemoe, name), name
    assert callable(safemoe.route) and callable(safemoe.experts) and callable(safemoe.moe)
    assert safemoe.HEALTH_SLOTS == 8
    health = safemoe.new_health_tensor()
    assert health.dtype == torch.int64 and health.shape == (8,) and int(health.sum()) == 0


@needs_install
def test_py_typed_marker_is_shipped() -> None:
    package_dir = Path(safemoe.__file__).parent
    assert (package_dir / "py.typed").is_file()
    files = importlib.metadata.files("safemoe") or []
    # An editable install lists no package files; a wheel install must list the marker.
    if any(str(f).startswith("safemoe/") for f in files):
        assert any(str(f) == "safemoe/py.typed" for f in files)


@needs_install
def test_console_script_entry_point() -> None:
    scripts = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "safemoe"]
    assert scripts and scripts[0].value == "safemoe.cli:main"


def test_import_chooses_the_triton_interpreter_without_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, safemoe; print(os.environ.get('TRITON_INTERPRET'))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    expected = "None" if torch.cuda.is_available() else "1"
    assert done.stdout.strip() == expected
