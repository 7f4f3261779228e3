"""One batch of a stream, ready to send: sample with the partition's sampler (asking the
peers for the rest, :class:`~sampling_server.peer_client.PeerRemote`), gather each node
type's rows (only those the trainer's feature cache lacks, with a cache plan; straight
into the stream messages where they span several), look up original IDs beside the
gather, read the sampled edges' original IDs and features where asked
(:meth:`~sampling_server.sampler.gather.Gatherer.edge_rows`), and name the tensors as ``docs/wire.md``
says: a plain graph's without a type (``n_id``, ``edge_index``, ``x``), a typed graph's
with one (``n_id/<type>``, ``edge_index/<src__rel__dst>``), in compact form where asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from google.protobuf.message import Message

from partitioner.graph import EdgeType, edge_type_name
from protos import codec, compact, fastwire
from protos import sampling_pb2 as pb
from protos.plan import BatchRef
from sampling_server.errors import RequestError, printable
from sampling_server.fields import edge_wire_dtype, wire_feature_dtype
from sampling_server.hot import HotNodes
from sampling_server.jobs import EpochJob
from sampling_server.link_jobs import LinkJob
from sampling_server.messages import Prepared, chunk_head
from sampling_server.node_tensors import NodeTensor, NodeTensors
from sampling_server.peer_client import PeerCallOptions, PeerClient, PeerRemote
from sampling_server.sampler import NeighborSampler, batch_key
from sampling_server.sampler.links import exclude_edges, link_seeds
from sampling_server.sampler.rows import begin
from sampling_server.sampler.types import SamplerOutput
from sampling_server.store import PartitionStore

log = logging.getLogger(__name__)


@dataclass
class Producer:
    """What producing a batch needs of its server (shared by every stream)."""

    store: PartitionStore
    peers: PeerClient | None
    #: Runs original-ID lookups and the labels of a batch whose features are partly
    #: cached beside the feature gather (all may wait on peers).
    lookups: Executor
    #: Node type -> the hot orders of the trainers' feature caches.
    hot_of: Callable[[str], HotNodes]
    #: A context that times one stage (``sample``, ``gather``) in the server's metrics.
    stage: Callable[[str], AbstractContextManager[None]]
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
    #: The node tensors whose rows batches may carry (None: none).
    node_tensors: NodeTensors | None = None


def produce(ctx: Producer, job: EpochJob, ref: BatchRef) -> Prepared:
    """Sample one batch and gather its rows: the batch, ready to encode and send."""
    started = time.perf_counter()
    store = ctx.store
    seeds = job.seeds_of(ref, store.partition_id)
    key = batch_key(job.seed, job.epoch, job.rank, job.plan.start.steps + ref.index)
    sampler = store.sampler(replace=job.replace, weighted=job.weighted)
    remote = PeerRemote(ctx.peers, PeerCallOptions(job.replace, job.weighted, job.feature_dtype), store.typed,
                        frozenset(store.feature_dtypes)) if ctx.peers is not None else None

    def name(kind: str, key: str | EdgeType) -> str:
        return f"{kind}/{key if isinstance(key, str) else edge_type_name(key)}" if job.typed else kind

    link_tensors: dict[str, codec.TensorLike] = {}
    with ctx.stage("sample"):
        if job.links is None:
            out = sampler.sample(seeds, job.seed_type, job.fanouts, key, remote, edges=job.edges)
        else:
            out, link_tensors = _link_sample(ctx, job, job.links, sampler, seeds, key, remote, name)

    named = structure_tensors(out, name, job.compact)
    named.update(link_tensors)
    orig_ids = {t: ctx.lookups.submit(sampler.orig_ids_of, t, n_id, remote)
                for t, n_id in out.node.items()} if job.original_ids else {}
    header = batch_header(job, out)
    if job.links is not None:
        header.num_seed_edges = len(seeds)
    head = chunk_head(ref.index, header)
    rows: list[fastwire.RowMessages] = []
    if job.features or job.labels:
        with ctx.stage("gather"):
            for t, n_id in out.node.items():
                gathered, messages = _gather(ctx, job, sampler, t, n_id, remote, head, name)
                named.update(gathered)
                rows.extend(messages)
    if job.edges:
        with ctx.stage("gather"):
            named.update(_edge_tensors(ctx, job, sampler, out, remote, name))
    if job.node_tensors:
        with ctx.stage("gather"):
            named.update(_node_tensor_rows(ctx, job, sampler, out, remote))
    for t, lookup in orig_ids.items():
        orig = lookup.result()  # bounded: peer calls carry deadlines
        named[name("orig_id", t)] = compact.narrowest(orig.cpu(), compact.INDEX_DTYPES) \
            if job.compact else orig
    prepared = Prepared.of(head, named, ctx.chunk_bytes, len(seeds), rows)
    log.debug("partition=%d client=%s rank=%d epoch=%d batch=%d: %d seeds, nodes %s, %d messages in "
              "%.1f ms", store.partition_id, printable(job.client_id), job.rank, job.epoch, ref.index,
              out.batch_size, {t: int(v.numel()) for t, v in out.node.items()}, len(prepared),
              1e3 * (time.perf_counter() - started))
    return prepared


def _link_sample(ctx: Producer, job: EpochJob, links: LinkJob, sampler: NeighborSampler,
                 positions: np.ndarray, key: int, remote: PeerRemote | None,
                 name: Callable[[str, EdgeType], str]) -> tuple[SamplerOutput, dict[str, codec.TensorLike]]:
    """Sample a link batch (its seed edges at ``positions``): its seed nodes, negatives and
    labelled edges (:func:`~sampling_server.sampler.links.link_seeds`), the neighborhood
    of those seeds, less the excluded edges."""
    store = ctx.store
    src, dst = np.asarray(links.src[positions]), np.asarray(links.dst[positions])
    given = np.asarray(links.given[positions]) if links.given is not None else None
    made = link_seeds(sampler, links.options, key, src, dst, links.labels_of(positions), given,
                      lambda t, orig: np.asarray(store.node_map(t)[orig], dtype=np.int64), remote)
    out = sampler.sample(made.seeds, job.seed_type, job.fanouts, key, remote, edges=job.edges)
    if links.exclude:
        exclude_edges(out, links.excluded_pairs(torch.from_numpy(src), torch.from_numpy(dst)),
                      {t: i.num_nodes for t, i in store.manifest.node_types.items()})
    et = links.options.edge_type
    return out, {name(kind, et): tensor for kind, tensor in made.tensors.items()}


def _edge_tensors(ctx: Producer, job: EpochJob, sampler: NeighborSampler, out: SamplerOutput,
                  remote: PeerRemote | None, name: Callable[[str, EdgeType], str]
                  ) -> dict[str, codec.TensorLike]:
    """Each relation's "e_id" and "edge_attr" as the job asks (features only of the
    relations with them), aligned with its edges."""
    named: dict[str, codec.TensorLike] = {}
    for et, edges in out.edge.items():
        stored = ctx.store.edge_feature_dtypes.get(et)
        dtype = None if stored is None else codec.dtype_to_torch(edge_wire_dtype(job.feature_dtype, stored))
        e_id, attr = sampler.edge_rows(et, edges, ids=job.edge_ids, dtype=dtype, remote=remote,
                                       features=job.edge_features and dtype is not None)
        if e_id is not None:
            named[name("e_id", et)] = compact.narrowest(e_id, compact.INDEX_DTYPES) if job.compact else e_id
        if attr is not None:
            named[name("edge_attr", et)] = attr
    return named


def node_tensors_of(tensors: NodeTensors | None, names: Sequence[str], field: str) -> list[NodeTensor]:
    """The node tensors ``names`` (a job's), each held here (else NOT_FOUND naming ``field``)."""
    if names and tensors is None:
        raise RequestError(f"{field}: expected no node tensors, this server holds none")
    return [tensors.get(n, "", f"{field}[{i}]") for i, n in enumerate(names)] if tensors is not None else []


def _node_tensor_rows(ctx: Producer, job: EpochJob, sampler: NeighborSampler, out: SamplerOutput,
                      remote: PeerRemote | None) -> dict[str, codec.TensorLike]:
    """Each node tensor's rows of the batch's nodes of its type (``rows:<name>``), those of
    other partitions' nodes from their servers, as the features are gathered."""
    tensors = ctx.node_tensors
    named: dict[str, codec.TensorLike] = {}
    for tensor in node_tensors_of(tensors, job.node_tensors, "EpochRequest.node_tensors"):
        assert tensors is not None
        name, node_type = tensor.spec.name, tensor.node_type

        def ask(asked: dict[int, torch.Tensor], name: str = name, node_type: str = node_type
                ) -> Mapping[int, torch.Tensor]:
            if remote is None:  # one partition: every row is here
                return {}
            return remote.node_tensor_rows(name, node_type, asked)

        named[codec.ROWS_PREFIX + name] = sampler.rows_from_owners(
            node_type, out.node[node_type], tuple(tensor.spec.dims), tensor.rows.dtype,
            partial(_read_rows, tensors, tensor), ask)
    return named


def _read_rows(tensors: NodeTensors, tensor: NodeTensor, ids: torch.Tensor) -> torch.Tensor:
    return tensors.read(tensor, ids.numpy(), 0, None)


def batch_header(job: EpochJob, out: SamplerOutput) -> pb.MinibatchHeader:
    """A batch's header: seed count and per-hop counts (per type on a typed graph)."""
    if not job.typed:
        (nodes,), (edges,) = out.num_sampled_nodes.values(), out.num_sampled_edges.values()
        return pb.MinibatchHeader(num_batches=job.num_batches, num_seed_nodes=out.batch_size,
                                  num_sampled_nodes=nodes, num_sampled_edges=edges)
    return pb.MinibatchHeader(
        num_batches=job.num_batches, num_seed_nodes=out.batch_size,
        typed_sampled_nodes=[pb.TypedCounts(name=t, counts=v) for t, v in out.num_sampled_nodes.items()],
        typed_sampled_edges=[pb.TypedCounts(name=edge_type_name(et), counts=v)
                             for et, v in out.num_sampled_edges.items()])


def structure_tensors(out: SamplerOutput, name: Callable[[str, str | EdgeType], str],
                      compact_form: bool) -> dict[str, codec.TensorLike]:
    """The batch's node IDs and edges: ``n_id`` and ``edge_index`` per type, or in compact
    form (``docs/wire.md``, "Compact structure"): IDs in int32 when every value fits; each
    relation's edges as the edges per target (``edge_count``) when they are grouped by
    target as the samplers produce them, and their sources (``edge_src``) less those of
    the edges that first reach a node (``edge_new``) when every relation from that source
    type allows it (else ``edge_index`` in int32)."""
    named: dict[str, codec.TensorLike] = {}
    for t, n_id in out.node.items():
        named[name("n_id", t)] = compact.narrowest(n_id.cpu(), compact.INDEX_DTYPES) if compact_form else n_id
    if not compact_form:
        for et in out.row:
            named[name("edge_index", et)] = out.edge_index(et)
        return named
    nodes = out.num_sampled_nodes
    counts = {et: compact.edges_per_target(out.col[et].cpu(), sum(nodes[et[2]]) - nodes[et[2]][-1])
              for et in out.row}
    by_source: dict[str, list[EdgeType]] = {}
    for et in out.row:
        by_source.setdefault(et[0], []).append(et)
    for source, relations in by_source.items():
        split: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if all(counts[et] is not None for et in relations):
            split = compact.split_typed_sources(
                {edge_type_name(et): out.row[et] for et in relations},
                {edge_type_name(et): out.num_sampled_edges[et] for et in relations},
                nodes[source][0], sum(nodes[source]))
        for et in relations:
            per_target = counts[et]
            if per_target is None:
                named[name("edge_index", et)] = compact.narrowest(out.edge_index(et).cpu(),
                                                                  compact.INDEX_DTYPES)
                continue
            found = split.get(edge_type_name(et))
            if found is not None:
                named[name("edge_src", et)], named[name("edge_new", et)] = found
            else:
                named[name("edge_src", et)] = compact.narrowest(out.row[et].cpu(), compact.INDEX_DTYPES)
            named[name("edge_count", et)] = per_target
    return named


def _row_messages(ctx: Producer, sampler: NeighborSampler, node_type: str, tensor: str,
                  head: Callable[[int, int], Message], count: int, dtype: torch.dtype
                  ) -> fastwire.RowMessages | None:
    """Stream messages to gather ``count`` feature rows of ``node_type`` straight into,
    where they span more than one message (else None: the rows go in a tensor, encoded
    with the batch's others)."""
    x = sampler.node_data.x.get(node_type)
    if x is None or x.ndim < 2:
        return None
    row = tuple(x.shape[1:])
    if not fastwire.RowMessages.worth_it(dtype, row, count, ctx.chunk_bytes):
        return None
    return fastwire.RowMessages(head, tensor, dtype, count, row, ctx.chunk_bytes)


def _gather(ctx: Producer, job: EpochJob, sampler: NeighborSampler, t: str, n_id: torch.Tensor,
            remote: PeerRemote | None, head: Callable[[int, int], Message],
            name: Callable[[str, str], str]
            ) -> tuple[dict[str, codec.TensorLike], list[fastwire.RowMessages]]:
    """One node type's "x" and "y" as the job asks; with a cache plan, "x" holds only the
    rows the trainer lacks and "x_cached" marks the others. "x" is gathered straight into
    its stream messages where it spans several (returned apart)."""
    want_x = job.features and t in ctx.store.feature_dtypes
    want_y = job.labels and t == ctx.store.manifest.target_type
    named: dict[str, codec.TensorLike] = {}
    if not (want_x or want_y):
        return named, []
    stored = ctx.store.feature_dtypes.get(t, pb.FLOAT32)
    wire = codec.dtype_to_torch(wire_feature_dtype(job.feature_dtype, stored, "EpochRequest.feature_dtype"))
    counts = (job.cache_counts or {}).get(t) if want_x else None
    nodes, labels = n_id, None
    if counts:  # every node's label but only the missing rows: two gathers, side by side
        if want_y:
            labels = begin(partial(sampler.gather, t, n_id, features=False, labels=True, remote=remote),
                           sampler.overlap_peers, pool=ctx.lookups)
        cached = ctx.hot_of(t).cached_mask(n_id, counts)
        nodes = n_id[torch.nonzero(~cached.to(n_id.device)).flatten()]
        named[name("x_cached", t)] = compact.pack_mask(cached) if job.compact else cached
    rows = _row_messages(ctx, sampler, t, name("x", t), head, nodes.numel(), wire) if want_x else None
    own_y = want_y and labels is None  # the labels in this gather (not beside it)
    x: torch.Tensor | None = None
    if rows is not None:
        y = sampler.gather_to(t, nodes, rows.blocks, labels=own_y, remote=remote)
    else:
        x, y = sampler.gather(t, nodes, features=want_x, labels=own_y, remote=remote, dtype=wire)
    if labels is not None:
        y = labels.result()[1]  # bounded: peer calls carry deadlines
    if x is not None:
        named[name("x", t)] = x  # already in the wire dtype
    if y is not None:
        named[name("y", t)] = compact.narrowest(y.cpu(), compact.LABEL_DTYPES) if job.compact else y
    return named, [rows] if rows is not None else []
