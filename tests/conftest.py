"""Test session setup.

Numba's CUDA simulator must be chosen before Numba is first imported: CUDA kernels run
on it unless a real GPU is usable (then the ``gpu``-marked tests run too).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

REAL_GPU = torch.cuda.is_available() and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0" if REAL_GPU else "1")

from graph_fixtures import KINDS, AnyGraph, mixed  # noqa: E402  (after the simulator is chosen)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REAL_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (none usable here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI's ``main`` run in process (``logging.basicConfig``) leaves the root logger a
    handler on the test's captured stderr, closed once the test ends: every later log
    line of a server thread then prints a "Logging error". Such handlers go after the
    test, and the root level is restored."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


def _small_range(tmp_path_factory: pytest.TempPathFactory, parts: int) -> Path:
    from partitioner import partition_graph
    from partitioner.synthetic import generate

    root = tmp_path_factory.mktemp(f"small-range-{parts}")
    partition_graph(generate("small", progress=False), parts, root, method="range", progress=False,
                    overwrite=True)
    return root


@pytest.fixture(scope="session")
def parts2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `small` graph in 2 range partitions, shared read-only by the server tests."""
    return _small_range(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def parts1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `small` graph as one range partition, shared read-only."""
    return _small_range(tmp_path_factory, 1)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch and Numba on one thread for the test: on a shared 2-core machine, two threads
    per process spin waiting for each other and run many times slower."""
    import numba

    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    numba.set_num_threads(numba_threads)



@pytest.fixture
def reserve_ports() -> Iterator[Callable[[int], list[int]]]:
    """``reserve_ports(n)``: ``n`` loopback ports held bound until the test ends
    (:func:`protos.ports.reserved_ports`): nothing listens there until a server the test
    starts binds one, and no other process can take them in between."""
    from protos.ports import reserved_ports

    with contextlib.ExitStack() as stack:
        yield lambda count: stack.enter_context(reserved_ports(count))


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each kind of graph in turn (a test module's own ``kind`` fixture takes precedence)."""
    return str(request.param)


@pytest.fixture(scope="module")
def graph(kind: str) -> AnyGraph:
    """The mixed test graph of ``kind`` (``graph_fixtures.mixed``)."""
    return mixed(kind)
