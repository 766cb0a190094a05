"""``tern bench NAME`` reaches every benchmark's own command line."""

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
