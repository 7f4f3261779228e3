"""What a DDP job of graphfeed-train needs whatever its graph: the process group
(torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
NCCL on GPUs, Gloo on CPUs; none for one rank), sums over the ranks, checkpoints and the
best-validation selection. A checkpoint (state dicts and plain values only, loaded with
``weights_only=True``) records the model config and the graph it was trained on (name and
fingerprint): ``--resume`` refuses one of another graph or model, in one line naming both.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("trainer_client.train")

#: File name of the checkpoint inside ``--checkpoint-dir`` (the latest epoch).
CHECKPOINT_NAME = "checkpoint.pt"
#: File name of the checkpoint of the epoch with the best validation accuracy.
BEST_NAME = "best.pt"


# ---- the process group -----------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    #: Global rank (``RANK``).
    rank: int
    #: Number of ranks (``WORLD_SIZE``).
    world_size: int
    #: Rank on this machine (``LOCAL_RANK``), picks the GPU.
    local_rank: int
    #: Device the model trains on.
    device: torch.device
    #: The process group's backend (``nccl`` or ``gloo``; ``""`` without one).
    backend: str = ""

    @property
    def comm_device(self) -> torch.device:
        """Where this job's own collectives' tensors live: the GPU under NCCL, else the CPU
        (gloo's collectives take CPU tensors; DDP's own buckets go either way)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None or value == "" else int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer in the environment, got {value!r}") from None


#: ``--dist-backend`` choices; ``auto``: NCCL on a CUDA device, gloo on the CPU.
DIST_BACKENDS = ("auto", "nccl", "gloo")


def setup_distributed(device: str, timeout: float, backend: str = "auto") -> DistEnv:
    """Read the torchrun environment, pick the device, start the process group (if any).

    ``backend``: one of :data:`DIST_BACKENDS`. gloo on CUDA devices lets several ranks
    share one GPU (``--device cuda:0`` on each), which NCCL refuses."""
    rank, world_size, local_rank = env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK, WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE, got {rank}, {world_size}")
    if backend not in DIST_BACKENDS:
        raise ValueError(f"--dist-backend: expected one of {', '.join(DIST_BACKENDS)}, got {backend!r}")
    dev = resolve_device(device, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    elif backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"--dist-backend nccl: expected a CUDA --device, got {str(dev)!r}; "
                         "use gloo on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size <= 1:
        return DistEnv(rank, world_size, local_rank, dev)
    # Collectives wait for the slowest rank's batch: bounded by the loader's timeouts.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=3 * timeout + 60))
    return DistEnv(rank, world_size, local_rank, dev, backend)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """The training device: ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK`` (``auto`` falls
    back to the CPU); CUDA is checked before anything starts."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (torch.cuda.is_available() is "
                         "False); use --device cpu, or auto")
    index = local_rank if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: expected a CUDA device in 0 .. {count - 1} on this machine "
                         f"(LOCAL_RANK={local_rank}), got cuda:{index}")
    return torch.device("cuda", index)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sums(values: Sequence[float], env: DistEnv) -> list[float]:
    """Sum ``values`` over all ranks (identity without a process group)."""
    if not env.distributed:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=env.comm_device)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


# ---- checkpoints -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records besides the weights, and what ``--resume`` checks."""

    #: The model config (``--model``, ``--hidden`` ...), compared as it is.
    config: dict[str, Any]
    #: The graph trained on (:meth:`TypedGraph.identity`: name and fingerprint).
    graph: dict[str, str]
    #: The graph's types and sizes (:meth:`TypedGraph.to_json`), which typed checkpoints
    #: kept in their config before they recorded the graph.
    facts: dict[str, object]
    #: Whose graph this run trains on, for messages ("the servers'", ...).
    source: str = "the servers'"


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    history: list[dict[str, Any]], record: RunRecord, task: dict[str, Any]) -> None:
    """Write the checkpoint atomically (state dicts and plain values only: no pickled
    objects); ``task``: the task's own state, kept only when it has some."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "history": history, "config": record.config, "graph": record.graph,
                **({"task": task} if task else {})}, tmp)
    os.replace(tmp, path)


def last_saved(directory: Path) -> tuple[Path, int] | None:
    """The latest checkpoint in ``directory`` and its epoch (None: none saved yet)."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    return path, int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["epoch"])


def _graph_named(graph: dict[str, str] | None) -> str:
    if not graph:
        return "a graph it does not record"
    fingerprint = graph.get("fingerprint", "")
    return f"graph {graph.get('name', '')!r}" + (f" (fingerprint {fingerprint[:12]})" if fingerprint else "")


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, record: RunRecord,
                    device: torch.device) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Load a checkpoint with ``weights_only=True`` into ``model`` and ``optimizer``;
    return (next epoch, history, the task's own state). A checkpoint of another graph, of
    another model config, or (one that does not record its graph) whose weights do not fit
    is refused with one line naming both."""
    state = torch.load(path, map_location=device, weights_only=True)
    config = dict(state.get("config") or {})
    facts = config.pop("graph", None)  # typed checkpoints that kept the graph's types there
    saved = state.get("graph")

    def refused(why: str) -> ValueError:
        return ValueError(f"--resume: checkpoint {path} holds {config} trained on {_graph_named(saved)}, "
                          f"not on {record.source} {_graph_named(record.graph)}{why}; resume against the "
                          f"graph it was trained on, or start in another --checkpoint-dir")

    # the same graph: the same fingerprint where both record one, else the same name
    same = "fingerprint" if saved and saved.get("fingerprint") and record.graph.get("fingerprint") else "name"
    if saved is not None and saved.get(same) != record.graph.get(same):
        raise refused("")
    if config != record.config:
        raise ValueError(f"--resume: checkpoint {path} was written for {config}, not {record.config}")
    if facts is not None and facts != record.facts:
        raise refused("")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:  # weights of another graph's shapes
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = next((line for line in lines if "size mismatch" in line), lines[-1] if lines else repr(exc))
        raise refused(f" ({detail})") from None
    return int(state["epoch"]) + 1, list(state["history"]), dict(state.get("task") or {})


# ---- the selection and a run's checkpoints -----------------------------------------


def parameter_fingerprints(model: torch.nn.Module, env: DistEnv) -> list[float]:
    """A float64 digest of every parameter, from every rank (rank order). DDP keeps the
    replicas bitwise equal, so the digests agree unless the ranks diverged."""
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.detach().to("cpu", torch.float64).flatten()
            total += (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum() * (i + 1)
    if not env.distributed:
        return [float(total)]
    mine = total.reshape(1).to(env.comm_device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(everyone, mine)
    return [float(t) for t in everyone]


@dataclass
class Selection:
    """The epoch with the best validation figure so far, and its model weights."""

    epoch: int | None = None
    score: float = -1.0
    state: dict[str, torch.Tensor] | None = None
    #: The task's own state at that epoch (what it needs to be that model again).
    task: dict[str, Any] = field(default_factory=dict)

    def offer(self, epoch: int, score: float, model: torch.nn.Module,
              task: dict[str, Any] | None = None) -> bool:
        """Keep ``model``'s weights (and the ``task``'s state) when ``score`` beats the
        best so far."""
        if score <= self.score:
            return False
        self.epoch, self.score, self.task = epoch, score, dict(task or {})
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    @classmethod
    def resumed(cls, history: list[dict[str, Any]], best_path: Path | None, device: torch.device,
                key: str) -> Selection:
        """The selection of a resumed run: its history's best epoch by ``key``, with the
        weights of ``best_path`` when that file holds that epoch."""
        if not history:
            return cls()
        best = max(history, key=lambda h: h[key])
        state, task = None, {}
        if best_path is not None and best_path.exists():
            saved = torch.load(best_path, map_location=device, weights_only=True)
            if int(saved["epoch"]) == int(best["epoch"]):
                state, task = saved["model"], dict(saved.get("task") or {})
        if state is None:
            log.warning("--resume: no %s for epoch %d; selecting among the epochs from here on",
                        BEST_NAME, best["epoch"])
            return cls()
        return cls(int(best["epoch"]), float(best[key]), state, task)


@dataclass
class RunState:
    """Where a run stands: the first epoch to train, the epochs' figures so far, the
    best-validation selection, and the task's own state from the checkpoint."""

    start: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    selection: Selection = field(default_factory=Selection)
    task: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoints:
    """A run's checkpoints in ``directory`` (``--checkpoint-dir``; None: none are
    written): :data:`CHECKPOINT_NAME` every epoch, :data:`BEST_NAME` at each new best."""

    directory: Path | None
    record: RunRecord

    def path(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / name

    def resume(self, resume: bool, model: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv,
               key: str) -> RunState:
        """The run's state: from the checkpoint with ``resume`` when there is one (its
        weights loaded into ``model`` and ``optimizer``, the selection by the history's
        ``key``), else fresh."""
        ckpt = self.path(CHECKPOINT_NAME)
        if not resume or ckpt is None or not ckpt.exists():
            return RunState()
        start, history, task = load_checkpoint(ckpt, model, optimizer, self.record, env.device)
        if any(key not in h for h in history):
            raise ValueError(f"--resume: checkpoint {ckpt} has no {key!r} in its epochs' figures (written by "
                             "another version of graphfeed-train); start in another --checkpoint-dir")
        log.info("resumed from %s at epoch %d", ckpt, start)
        selection = Selection.resumed(history, self.path(BEST_NAME), env.device, key)
        return RunState(start, history, selection, task)

    def keep(self, row: dict[str, Any], score: float, state: RunState, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, env: DistEnv, task: dict[str, Any]) -> bool:
        """Append an epoch's ``row`` (its ``"epoch"`` and plain values) to the history,
        offer the model to the selection with validation figure ``score``, and (rank 0)
        write the checkpoint and, when it improved, the best one (with the task's own
        state ``task``). Returns whether it improved."""
        epoch = int(row["epoch"])
        state.history.append(row)
        improved = state.selection.offer(epoch, score, model, task)
        for name, due in ((CHECKPOINT_NAME, True), (BEST_NAME, improved)):
            path = self.path(name)
            if due and path is not None and env.rank == 0:
                save_checkpoint(path, model, optimizer, epoch, state.history, self.record, task)
        return improved


def restore_selected(model: torch.nn.Module, selection: Selection, env: DistEnv) -> list[float]:
    """Load the selected epoch's weights (if any); return the replicas' parameter
    fingerprints, with a warning when they differ."""
    if selection.state is not None:
        model.load_state_dict(selection.state)
    fingerprints = parameter_fingerprints(model, env)
    if len(set(fingerprints)) != 1:
        log.warning("model replicas differ across ranks: %s", fingerprints)
    return fingerprints
