"""benchmarks/results/ holds what the documentation cites, and nothing else; the files
cited are there; and neither the documents nor the results speak of how the project was
developed (run labels, how a machine was obtained) instead of the machine and command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: Words that name a run (a letter and its number) or how a machine was obtained, where
#: the machine and the command should be named instead.
DEVELOPMENT_WORDS = re.compile(r"\b(leases?|leased|lent|device tool|[GS]\d{1,2})\b", re.IGNORECASE)


def documents() -> dict[Path, str]:
    """The README, docs/ and the benchmarks' READMEs."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "benchmarks").rglob("README.md")), REPO / "examples" / "README.md"]
    return {p: p.read_text() for p in paths if p.is_file()}


def committed_results() -> list[Path]:
    """The files of benchmarks/results that git tracks (a fresh run's output is not
    committed until the documentation cites it); every file there outside a checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True,
                             text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in RESULTS.iterdir() if p.is_file())
    return [REPO / line for line in out.splitlines() if line.strip()]


def test_every_result_file_is_cited_by_the_documentation() -> None:
    text = "\n".join(documents().values())
    uncited = [p.name for p in committed_results() if p.name not in text]
    assert not uncited, f"benchmarks/results/ holds files no document cites: {uncited}"


def test_every_result_file_the_documentation_cites_is_there() -> None:
    cited = {m for text in documents().values()
             for m in re.findall(r"results/([\w.-]+\.(?:json|png))", text)}
    assert cited, "the documents cite no results at all"
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


@pytest.mark.parametrize("kind", ["documents", "results"])
def test_no_words_of_how_the_project_was_developed(kind: str) -> None:
    texts = documents() if kind == "documents" else \
        {p: p.read_text() for p in committed_results() if p.suffix == ".json"}
    found = [f"{p.relative_to(REPO)}: {m.group(0)!r} in ...{text[max(m.start() - 40, 0):m.end() + 40]}..."
             for p, text in texts.items() for m in DEVELOPMENT_WORDS.finditer(text)]
    assert not found, "name the machine and the command instead:\n" + "\n".join(found[:20])
