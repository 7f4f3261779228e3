"""Regenerate the Python stubs of ``protos/sampling.proto``.

Run from anywhere (the paths are resolved from this file)::

    python -m protos.generate            # rewrite the stubs checked into protos/
    python -m protos.generate --out DIR  # write them into DIR instead
    python -m protos.generate --check    # exit 1, naming the files, if stubs are stale

``protoc`` takes the repository root as its only project include path (``-I <root>``, the
same as ``-I .`` run from the root, without changing the working directory), so the proto
is known as ``protos/sampling.proto`` and the generated gRPC module imports
``from protos import sampling_pb2``. Typed stubs come from mypy-protobuf
(``sampling_pb2.pyi`` and ``sampling_pb2_grpc.pyi``). The output depends only on the
``.proto`` file and the pinned versions of grpcio-tools and mypy-protobuf.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: The package directory holding ``sampling.proto`` and its stubs.
PROTOS_DIR = Path(__file__).resolve().parent
#: The repository root, the ``-I`` include path of ``protoc``.
REPO_ROOT = PROTOS_DIR.parent
#: The proto file, relative to :data:`REPO_ROOT` (its path decides the import lines).
PROTO_FILE = "protos/sampling.proto"
#: The generated files, in the order they are reported.
GENERATED_FILES: tuple[str, ...] = (
    "sampling_pb2.py",
    "sampling_pb2.pyi",
    "sampling_pb2_grpc.py",
    "sampling_pb2_grpc.pyi",
)


class GenerateError(RuntimeError):
    """``protoc`` or one of its plugins failed or is missing."""


def _plugin(name: str) -> str:
    """Return the path of the protoc plugin executable ``name`` (next to the interpreter)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise GenerateError(
            f"protoc plugin {name!r}: expected it beside {sys.executable} or on PATH, "
            "got nothing (install the dev extras: pip install -e '.[dev]')"
        )
    return found


def _run_protoc(out_root: Path) -> None:
    """Run ``protoc`` with the repository root as include path, writing every stub under
    ``out_root/protos``."""
    from importlib import resources

    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    status = protoc.main([
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        str(REPO_ROOT / PROTO_FILE),
    ])
    if status != 0:
        raise GenerateError(f"protoc exit status: expected 0, got {status} for {PROTO_FILE}")


def generate(out_dir: Path | None = None) -> list[Path]:
    """Generate the stubs into ``out_dir`` (default: the ``protos`` package directory).

    Returns the paths written, in :data:`GENERATED_FILES` order.
    """
    target = PROTOS_DIR if out_dir is None else Path(out_dir).resolve()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="graphfeed-protoc-") as tmp:
        _run_protoc(Path(tmp))
        written = []
        for name in GENERATED_FILES:
            source = Path(tmp) / "protos" / name
            if not source.is_file():
                raise GenerateError(f"{name}: expected protoc to write it, got no file")
            destination = target / name
            destination.write_bytes(source.read_bytes())
            written.append(destination)
    logger.info("wrote %s into %s", ", ".join(GENERATED_FILES), target)
    return written


def stale_files(stubs_dir: Path | None = None) -> list[str]:
    """Return the names of the stubs in ``stubs_dir`` that differ from a fresh generation.

    A missing stub counts as stale. ``stubs_dir`` defaults to the ``protos`` package.
    """
    committed = PROTOS_DIR if stubs_dir is None else Path(stubs_dir)
    with tempfile.TemporaryDirectory(prefix="graphfeed-stubs-") as tmp:
        generate(Path(tmp))
        stale = []
        for name in GENERATED_FILES:
            old = committed / name
            if not old.is_file() or old.read_bytes() != (Path(tmp) / name).read_bytes():
                stale.append(name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="only report stale stubs (exit status 1)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.check:
        stale = stale_files(args.out)
        for name in stale:
            logger.error("%s is stale: run python -m protos.generate", name)
        return 1 if stale else 0
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
