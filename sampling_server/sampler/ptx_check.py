"""Compile every CUDA kernel for a real GPU architecture and assemble it with ``ptxas``.

The simulator accepts code that is not valid CUDA, so CI also compiles each kernel of
:mod:`cuda_kernels` and :mod:`cuda_features` with the argument types its launcher passes
(``cuda_kernels.SIGNATURES``, see :func:`kernel_signatures`) through
``numba.cuda.compile_ptx`` (libNVVM, no GPU or driver needed), then assembles the PTX
with ``ptxas -v`` and reads back registers per thread, spills and stack use.

Run ``python -m sampling_server.sampler.ptx_check`` for a table (``--json`` for machine
output). Exit status: 0 all kernels assembled, 1 a kernel failed (named), 2 the toolchain
(ptxas or libNVVM) is missing. Must run without ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The architecture CI compiles for (Hopper).
DEFAULT_CC = (9, 0)


class ToolchainMissing(RuntimeError):
    """ptxas or libNVVM is not installed, so nothing can be compiled."""


class KernelBuildError(RuntimeError):
    """A kernel failed to compile or assemble; the message names it."""


@dataclass
class KernelReport:
    """Resources of one kernel compiled for one signature."""

    #: Kernel name (``cuda_kernels`` attribute).
    kernel: str
    #: Argument types, as Numba prints them.
    signature: str
    #: Registers per thread.
    registers: int
    #: Bytes spilled to local memory (stores / loads).
    spill_stores: int
    spill_loads: int
    #: Bytes of stack frame per thread.
    stack_frame: int


def find_ptxas() -> str:
    """Path of ``ptxas``: ``$PATH``, then ``$CUDA_HOME/bin``, then ``/usr/local/cuda/bin``."""
    found = shutil.which("ptxas")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "ptxas").is_file():
            return str(Path(root) / "bin" / "ptxas")
    raise ToolchainMissing("ptxas not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin")


def _check_nvvm() -> None:
    from numba.cuda.cudadrv.nvvm import NVVM

    try:
        NVVM()
    except Exception as exc:  # Numba raises several types for a missing or broken libNVVM
        raise ToolchainMissing(f"libNVVM could not be loaded ({type(exc).__name__}: {exc})") from exc


_RESOURCES = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_ptxas_info(text: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ``ptxas -v`` output (one entry function)."""
    values = {}
    for field, pattern in _RESOURCES.items():
        found = pattern.search(text)
        values[field] = int(found.group(1)) if found else 0
    if "registers" not in text:
        raise ValueError(f"no register count in ptxas output: {text.strip()[:200]}")
    return values


def assemble(ptx: str, ptxas: str, cc: tuple[int, int], name: str) -> dict[str, int]:
    """Assemble ``ptx`` for ``sm_<cc>`` and return its resource use."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{name}.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=False,
        )
    if proc.returncode != 0:
        raise KernelBuildError(f"{name}: ptxas failed: {proc.stderr.strip()[:2000]}")
    return parse_ptxas_info(proc.stderr + proc.stdout)


def kernel_signatures() -> list[tuple[str, Any, list[tuple[Any, ...]]]]:
    """``(name, kernel, argument-type tuples)`` of every CUDA kernel of the project."""
    from sampling_server.sampler import cuda_features, cuda_kernels  # noqa: F401 - registers its kernel

    return [(name, cuda_kernels.KERNELS[name], sigs) for name, sigs in cuda_kernels.SIGNATURES.items()]


def check_kernels(cc: tuple[int, int] = DEFAULT_CC) -> list[KernelReport]:
    """Compile and assemble every kernel with every launcher signature."""
    from numba import config as numba_config

    if getattr(numba_config, "ENABLE_CUDASIM", 0):
        raise RuntimeError("ptx_check: unset NUMBA_ENABLE_CUDASIM; the simulator cannot compile")
    ptxas = find_ptxas()
    _check_nvvm()
    from numba import cuda

    reports = []
    for name, kernel, sigs in kernel_signatures():
        for sig in sigs:
            shown = "(" + ", ".join(str(t) for t in sig) + ")"
            try:
                ptx, _ = cuda.compile_ptx(kernel, sig, cc=cc)
            except Exception as exc:
                raise KernelBuildError(
                    f"{name}{shown}: compile_ptx failed: {type(exc).__name__}: {exc}") from exc
            reports.append(KernelReport(name, shown, **assemble(ptx, ptxas, cc, name)))
    return reports


def format_table(reports: list[KernelReport]) -> str:
    rows = [("kernel", "regs", "spill st/ld", "stack", "signature")]
    rows += [(r.kernel, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
              str(r.stack_frame), r.signature) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
                     + "  " + row[4] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 (sm_90)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of reports")
    args = parser.parse_args(argv)
    major, _, minor = args.cc.partition(".")
    out: dict[str, Any]
    try:
        reports = check_kernels((int(major), int(minor or 0)))
    except ToolchainMissing as exc:
        out, code = {"status": "toolchain-missing", "error": str(exc)}, 2
    except KernelBuildError as exc:
        out, code = {"status": "failed", "error": str(exc)}, 1
    else:
        out, code = {"status": "ok", "kernels": [asdict(r) for r in reports]}, 0
    if args.json:
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
    elif code == 0:
        sys.stdout.write(format_table(reports) + "\n")
    else:
        sys.stderr.write(f"ptx_check: {out['error']}\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
