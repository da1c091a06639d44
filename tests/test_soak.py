"""`safemoe soak` on CPU (eager, reference backend): a clean run counts no violation, an injected
fault is counted, and bad command lines are usage errors. The GPU run (CUDA graph, 100,000
replays) is in scripts/gpu_run.sh's soak stage."""

from __future__ import annotations

import pytest
import torch

from safemoe import soak as soak_module
from safemoe.cli import main


def test_clean_soak_counts_nothing():
    report = soak_module.soak(replays=12, device="cpu", model="mixtral", max_tokens=8, seed=3)
    assert report.replays == 12 and not report.graphed
    assert report.violations == dict.fromkeys(soak_module.INVARIANTS, 0), report.violations
    assert report.ok


def test_injected_faults_are_counted(monkeypatch):
    real = soak_module._Step._experts

    def leaky(self, routing):  # writes into padded rows and makes valid rows depend on padding
        out = real(self, routing)
        return out + (self.x[-1:].abs() > 1).to(out.dtype)  # the last row is padding whenever n < T

    monkeypatch.setattr(soak_module._Step, "_experts", leaky)
    report = soak_module.soak(replays=10, device="cpu", model="mixtral", max_tokens=8, seed=1)
    assert not report.ok
    assert report.violations["padded_rows_nonzero"] > 0
    assert report.violations["padding_leaks"] > 0


def test_cli_reports_and_writes_json(tmp_path, capsys):
    path = tmp_path / "soak.json"
    argv = ["soak", "--replays", "4", "--max-tokens", "4", "--model", "mixtral", "--json", str(path)]
    assert main(argv) == 0
    assert "safemoe soak: OK" in capsys.readouterr().out
    assert '"ok": true' in path.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["--replays", "0"],
        ["--replays", "-3"],
        ["--max-tokens", "x"],
        ["--model", "nosuch"],
        ["--device", "tpu"],
        pytest.param(
            ["--device", "cuda"], marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")
        ),
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert main(["soak", *argv]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_json_under_a_plain_file_is_a_usage_error(tmp_path, capsys):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert main(["soak", "--replays", "1", "--json", str(plain / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "argument --json" in err and "Traceback" not in err
