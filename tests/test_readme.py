"""The README's loader snippet runs as written (against real servers, one epoch)."""

from __future__ import annotations

import re
from pathlib import Path

from test_loader import real_servers

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_loader_snippet_runs(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    snippet = next(b for b in blocks if "RemoteNeighborLoader(servers" in b)
    with real_servers(tmp_path / "small-2") as addresses:
        code = snippet.replace('["127.0.0.1:50051", "127.0.0.1:50052"]', repr(addresses))
        code = code.replace("range(10)", "range(1)")
        assert code != snippet
        scope: dict[str, object] = {}
        exec(compile(code, "README.md", "exec"), scope)
        assert scope["epoch"] == 0
