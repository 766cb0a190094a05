"""The benchmark registry is the index: ``tern bench``'s entries, docs/benchmarks.md and the files in
bench/ and docs/benchmarks/ agree (as test_import_contract.py holds the packages' arrows to the docs).

- every registered benchmark is listed in docs/benchmarks.md, and every listed one is registered;
- every claim a benchmark backs (and every anchor docs/benchmarks.md links to) names a heading;
- a benchmark with results has docs/benchmarks/<name>/<cpu-or-gpu>-<commit>/ folders, and nothing
  else is there but retired benchmarks' results and pages;
- every file in bench/ is a registered module or a helper of a registered benchmark.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tern_cli.bench import BENCHMARKS, HELPERS, RETIRED

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INDEX = DOCS / "benchmarks.md"
RESULTS = DOCS / "benchmarks"
RUN_FOLDER = re.compile(r"(cpu|gpu)-[0-9a-f]{7}")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def listed() -> list[str]:
    """The benchmarks docs/benchmarks.md's table lists (its first column: `tern bench NAME`)."""
    return re.findall(r"^\| `tern bench ([a-z0-9-]+)` \|", INDEX.read_text(), flags=re.MULTILINE)


def test_every_registered_benchmark_is_listed_and_every_listed_one_registered() -> None:
    names = listed()
    assert len(names) == len(set(names)), "a benchmark is listed twice"
    assert set(BENCHMARKS) - set(names) == set(), "register in tern_cli/bench.py, list in docs/benchmarks.md"
    assert set(names) - set(BENCHMARKS) == set(), "listed in docs/benchmarks.md, not in tern bench"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_row_names_its_module_claim_and_results(name: str) -> None:
    bench = BENCHMARKS[name]
    (row,) = [line for line in INDEX.read_text().splitlines() if line.startswith(f"| `tern bench {name}` |")]
    assert f"`{bench.module}`" in row
    assert f"({bench.claim.removeprefix('docs/')})" in row
    assert (f"(benchmarks/{name}/)" in row) == bench.results
    assert (ROOT / (bench.module.replace(".", "/") + ".py")).is_file()


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_claim_is_a_heading_in_the_docs(name: str) -> None:
    page, _, anchor = BENCHMARKS[name].claim.partition("#")
    assert page.startswith("docs/") and (ROOT / page).is_file(), BENCHMARKS[name].claim
    assert anchor in anchors(ROOT / page), f"{name}: no heading #{anchor} in {page}"


def test_every_anchor_the_index_links_to_resolves() -> None:
    for page, anchor in re.findall(r"\]\(([^)#\s]+\.md)#([^)\s]+)\)", INDEX.read_text()):
        assert anchor in anchors(DOCS / page), f"docs/benchmarks.md links to {page}#{anchor}: no such heading"


def test_results_live_in_one_folder_per_benchmark_and_run() -> None:
    with_results = {name for name, bench in BENCHMARKS.items() if bench.results}
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    assert with_results - folders == set(), "a benchmark said to have results has no folder"
    assert folders - with_results - set(RETIRED) == set(), "a results folder of no benchmark"
    for folder in folders:
        runs = [p for p in (RESULTS / folder).iterdir()]
        bad = [p.name for p in runs if not (p.is_dir() and RUN_FOLDER.fullmatch(p.name))]
        assert not bad, f"docs/benchmarks/{folder}/ holds {bad}: results go in <cpu-or-gpu>-<commit>/"
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.suffix != ".md"]
    assert not loose, f"loose results in docs/benchmarks/: {loose}"


def test_every_file_in_bench_is_a_benchmark_or_a_helper_of_one() -> None:
    modules = {bench.module.replace(".", "/") + ".py" for bench in BENCHMARKS.values()}
    files = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "bench").glob("*/*")
        if p.is_file() and p.name != "__init__.py" and p.suffix in (".py", ".sh", ".json")
    }
    unregistered = files - modules - set(HELPERS)
    assert not unregistered, f"register {unregistered} in tern bench or as HELPERS, or retire them"
    assert set(HELPERS) - files == set(), "HELPERS names files that are gone"
    assert set(HELPERS.values()) <= set(BENCHMARKS)


def test_retired_benchmarks_are_gone_and_cited() -> None:
    index = INDEX.read_text()
    for name, commit in RETIRED.items():
        assert name not in BENCHMARKS
        (row,) = [line for line in index.splitlines() if line.startswith(f"| {name} ")]
        assert commit in row, f"cite the commit {name}'s script is at"
