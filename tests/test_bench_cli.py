"""``tern bench NAME`` reaches every benchmark's own command line."""

import subprocess
import sys

import pytest

from tern_cli.bench import BENCHMARKS, main


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "tern bench {" in capsys.readouterr().err


def test_tern_bench_help_lists_each_benchmark_in_one_line() -> None:
    """Issue 18: through the real command, exit 0, one line per benchmark, no benchmark imported."""
    result = subprocess.run(
        [sys.executable, "-m", "tern_cli", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in BENCHMARKS:
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert len(line.split()) > 3, f"{name} has a one-line description"
