"""graphfeed never needs PyG's optional native packages (torch-sparse, torch-scatter,
pyg-lib): `make test` may install them for the accuracy comparison with PyG's own
NeighborLoader, so this checks, in a child process that cannot import them, that every
part of graphfeed imports and samples a batch without them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys

    BLOCKED = {"torch_sparse", "torch_scatter", "pyg_lib", "torch_cluster", "torch_spline_conv"}
    for name in BLOCKED:  # as if not installed: imports fail, find_spec answers None
        sys.modules[name] = None
    import numpy as np
    import partitioner, protos.codec, sampling_server.server, trainer_client.loader, trainer_client.train
    from partitioner.synthetic import generate
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler  # noqa: F401
    graph = generate("small")
    assert graph.num_nodes > 0
    assert all(sys.modules[name] is None for name in BLOCKED)
    print("ok")
""")


def test_graphfeed_imports_without_pyg_native_packages() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"NUMBA_ENABLE_CUDASIM": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
