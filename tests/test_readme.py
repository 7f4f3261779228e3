"""The README as a new user reads it: the loader snippet runs as written (against real
servers, one epoch), the two commands are the two commands, and every link of the README
and the documentation leads to a file that exists (and to a heading that exists)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_loader import real_servers

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_the_readme_loader_snippet_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    snippet = next(b for b in blocks if "RemoteNeighborLoader(servers" in b)
    with real_servers(tmp_path / "small-2") as addresses:
        code = snippet.replace('["127.0.0.1:50051", "127.0.0.1:50052"]', repr(addresses))
        code = code.replace("range(10)", "range(1)")
        assert code != snippet
        scope: dict[str, object] = {}
        exec(compile(code, "README.md", "exec"), scope)
        assert scope["epoch"] == 0


@pytest.mark.slow
def test_the_readme_s_pyg_data_to_training_example_runs_as_written(tmp_path: Path) -> None:
    """The worked example, verbatim, in a fresh directory: it partitions, starts the
    servers, trains and tests, and exits cleanly."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    example = next(b for b in blocks if "from_pyg(" in b and "graphfeed-local" in b)
    (tmp_path / "example.py").write_text(example)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "parts" / "my-graph-2" / "manifest.json").is_file()
    assert re.search(r"test acc \d\.\d+", run.stderr), run.stderr[-3000:]


def test_the_two_commands_are_make_demo_and_make_test() -> None:
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    assert [line.split("#")[0].strip() for line in block.group(1).splitlines()] == ["make demo", "make test"]


def test_the_first_screen_says_what_it_is_and_shows_the_commands_and_the_loader() -> None:
    first_screen = "\n".join(README.splitlines()[:80])
    assert "sampling service" in first_screen
    assert "make demo" in first_screen and "make test" in first_screen
    assert "RemoteNeighborLoader(servers" in first_screen


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "benchmarks").rglob("README.md")), REPO / "examples" / "README.md"]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(doc: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: links to nothing: {broken}"
