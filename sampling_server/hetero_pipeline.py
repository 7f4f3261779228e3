"""Typed batches through the server: sample with the typed sampler, ask the peers for
the rest (:class:`TypedPeers`, the ``HeteroRemote`` over ``PeerService``), gather per
node type and encode as the typed tensors of ``docs/wire.md``.

The homogeneous pipeline runs the stream (prefetch, cancellation, metrics); only the
production of one batch differs (:func:`produce_typed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from partitioner.graph import EdgeType, edge_type_name, parse_edge_type
from protos import codec, compact
from protos import sampling_pb2 as pb
from protos.plan import BatchRef
from sampling_server.limits import printable
from sampling_server.peer import NodeData, PeerCallOptions, PeerClient
from sampling_server.sampler import NumNeighbors, batch_key
from sampling_server.sampler.base import begin
from sampling_server.sampler.hetero_types import HeteroSamplerOutput
from sampling_server.sampler.types import HopSample
from sampling_server.store import cast_features

if TYPE_CHECKING:
    from sampling_server.hetero_store import HeteroPartitionStore
    from sampling_server.pipeline import EpochJob, Prepared, SamplingPipeline, TypedJob

log = logging.getLogger(__name__)


class TypedPeers:
    """The typed sampler's ``HeteroRemote``, answered by the peers' ``PeerService``: one
    batched call per peer per relation and hop (per node type for node data), the peers
    called concurrently, every call with a deadline (see :class:`PeerClient`)."""

    def __init__(self, client: PeerClient, options: PeerCallOptions,
                 feature_types: frozenset[str]) -> None:
        self.client = client
        self.options = options
        #: Node types with features (only they are asked for "x").
        self.feature_types = feature_types

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor],
               fanout: int, key: int, hop: int) -> dict[int, HopSample]:
        return self.client.neighbors(nodes_by_partition, fanout, key, hop, self.options,
                                     edge_type=edge_type_name(edge_type))

    def node_data(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor],
                  features: bool, labels: bool) -> dict[int, NodeData]:
        return self.client.node_data(nodes_by_partition, features and node_type in self.feature_types,
                                     labels, self.options, node_type=node_type)

    def orig_ids(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor]
                 ) -> dict[int, torch.Tensor]:
        return self.client.orig_ids(nodes_by_partition, node_type=node_type)


def typed_header(num_batches: int, out: HeteroSamplerOutput) -> pb.MinibatchHeader:
    """The header of a typed batch: seed count and per-type per-hop counts."""
    return pb.MinibatchHeader(
        num_batches=num_batches, num_seed_nodes=out.batch_size,
        typed_sampled_nodes=[pb.TypedCounts(name=t, counts=v)
                             for t, v in out.num_sampled_nodes.items()],
        typed_sampled_edges=[pb.TypedCounts(name=edge_type_name(et), counts=v)
                             for et, v in out.num_sampled_edges.items()])


def compact_typed(named: Mapping[str, codec.TensorLike], nodes: Mapping[str, Sequence[int]],
                  edges: Mapping[str, Sequence[int]]) -> dict[str, codec.TensorLike]:
    """A typed batch's tensors in compact form (``EpochRequest.compact_indices``,
    ``docs/wire.md``): IDs in int32 when every value fits; each relation's edges as the
    edges per target (``edge_count/E``) when they are grouped by target as the samplers
    produce them, and their sources (``edge_src/E``) less those of the edges that first
    reach a node (``edge_new/E``) when every relation from that source type allows it
    (else ``edge_index/E`` in int32); labels in the narrowest signed dtype, cache masks
    as bits; features as they are. ``nodes``: per node type its nodes per hop (seeds
    first), ``edges``: per relation name its edges per hop (``typed_sampled_*``)."""
    narrow = {"n_id": compact.INDEX_DTYPES, "orig_id": compact.INDEX_DTYPES,
              "y": compact.LABEL_DTYPES}
    out: dict[str, codec.TensorLike] = {}
    relations: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        kind, _, key = name.partition("/")
        if kind in narrow:
            t = compact.narrowest(torch.as_tensor(t).cpu(), narrow[kind])
        elif kind == "x_cached":
            t = compact.pack_mask(torch.as_tensor(t))
        elif kind == "edge_index":
            relations[key] = torch.as_tensor(t).cpu()
            continue
        out[name] = t
    counts = {key: compact.edges_per_target(ei[1], _num_targets(nodes[parse_edge_type(key)[2]]))
              for key, ei in relations.items()}
    by_source: dict[str, list[str]] = {}
    for key in relations:
        by_source.setdefault(parse_edge_type(key)[0], []).append(key)
    for source, keys in by_source.items():
        split = compact.split_typed_sources(
            {k: relations[k][0] for k in keys}, {k: edges[k] for k in keys}, nodes[source][0],
            sum(nodes[source])) if all(counts[k] is not None for k in keys) else {}
        for k in keys:
            per_target = counts[k]
            if per_target is None:
                out[f"edge_index/{k}"] = compact.narrowest(relations[k], compact.INDEX_DTYPES)
                continue
            if k in split:
                out[f"edge_src/{k}"], out[f"edge_new/{k}"] = split[k]
            else:
                out[f"edge_src/{k}"] = compact.narrowest(relations[k][0], compact.INDEX_DTYPES)
            out[f"edge_count/{k}"] = per_target
    return out


def _num_targets(nodes: Sequence[int]) -> int:
    """The possible targets of a relation's edges: its destination type's nodes of every
    hop but the last (``nodes``: that type's nodes per hop)."""
    return sum(nodes) - nodes[-1]


def produce_typed(pipeline: SamplingPipeline, job: EpochJob, typed: TypedJob,
                  ref: BatchRef) -> Prepared:
    """Sample one typed batch and gather its rows per node type: ready to send."""
    store: HeteroPartitionStore = pipeline.store  # type: ignore[assignment]
    started = time.perf_counter()
    seeds = job.seeds_of(ref, store.partition_id)
    key = batch_key(job.seed, job.epoch, job.rank, ref.index)
    sampler = store.typed_sampler(replace=job.replace)
    remote = None
    if pipeline.peers is not None:
        remote = TypedPeers(pipeline.peers, PeerCallOptions(job.replace, False, job.feature_dtype),
                            frozenset(store.feature_dtypes))
    with pipeline.stage("sample"):
        out = sampler.sample(seeds, typed.seed_type, cast(NumNeighbors, typed.fanouts), key, remote)
    named: dict[str, codec.TensorLike] = {}
    for t, n_id in out.node.items():
        named[f"n_id/{t}"] = n_id
    for et in out.row:
        named[f"edge_index/{edge_type_name(et)}"] = out.edge_index(et)
    target = store.manifest.target_type
    orig_ids = {t: pipeline.lookups.submit(sampler.orig_ids_of, t, n_id, remote)
                for t, n_id in out.node.items()} if job.original_ids else {}
    if job.features or job.labels:
        with pipeline.stage("gather"):
            for t, n_id in out.node.items():
                want_y = job.labels and t == target
                want_x = job.features and t in store.feature_dtypes
                if not (want_x or want_y):
                    continue
                counts = typed.cache_counts.get(t) if want_x else None
                if counts:  # only the rows the trainer lacks; every label, side by side
                    labels = begin(partial(sampler.gather, t, n_id, features=False, labels=True,
                                           remote=remote), sampler.overlap_peers,
                                   pool=pipeline.lookups) if want_y else None
                    cached = pipeline.hot_of(t).cached_mask(n_id, counts)
                    missing = torch.nonzero(~cached.to(n_id.device)).flatten()
                    x, _ = sampler.gather(t, n_id[missing], features=True, labels=False,
                                          remote=remote)
                    y = labels.result()[1] if labels is not None else None  # peer deadlines
                    named[f"x_cached/{t}"] = cached
                else:
                    x, y = sampler.gather(t, n_id, features=want_x, labels=want_y, remote=remote)
                if x is not None:
                    wire = job.feature_dtype or store.feature_dtypes[t]
                    named[f"x/{t}"] = cast_features(x, wire)
                if y is not None:
                    named[f"y/{t}"] = y
    for t, lookup in orig_ids.items():
        named[f"orig_id/{t}"] = lookup.result()  # bounded: peer calls carry deadlines
    if job.compact:
        named = compact_typed(named, out.num_sampled_nodes,
                              {edge_type_name(et): v for et, v in out.num_sampled_edges.items()})
    prepared = pipeline.prepare(ref, typed_header(job.num_batches, out), named, len(seeds))
    log.debug("partition=%d client=%s rank=%d epoch=%d batch=%d: typed, %d seeds of %s, nodes %s, "
              "%d messages in %.1f ms", store.partition_id, printable(job.client_id), job.rank,
              job.epoch, ref.index, out.batch_size, typed.seed_type,
              {t: int(v.numel()) for t, v in out.node.items()}, len(prepared),
              1e3 * (time.perf_counter() - started))
    return prepared
