"""The generated stubs in protos/ match sampling.proto, and the proto is fully documented."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
pytest.importorskip("mypy_protobuf", reason="mypy-protobuf (dev extra) writes the .pyi stubs")

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from protos import generate


def test_committed_stubs_are_up_to_date() -> None:
    stale = generate.stale_files()
    assert not stale, (
        f"stale generated stubs in protos/: {', '.join(stale)}; "
        "regenerate them with: python -m protos.generate"
    )


def test_a_stale_stub_is_named(tmp_path: Path) -> None:
    for name in generate.GENERATED_FILES:
        shutil.copy(generate.PROTOS_DIR / name, tmp_path / name)
    stale_file = tmp_path / "sampling_pb2_grpc.py"
    stale_file.write_text(stale_file.read_text() + "\n# edited by hand\n")
    (tmp_path / "sampling_pb2.pyi").unlink()
    assert generate.stale_files(tmp_path) == ["sampling_pb2.pyi", "sampling_pb2_grpc.py"]


def test_generation_is_deterministic(tmp_path: Path) -> None:
    first = generate.generate(tmp_path / "a")
    second = generate.generate(tmp_path / "b")
    assert [p.name for p in first] == list(generate.GENERATED_FILES)
    for one, two in zip(first, second, strict=True):
        assert one.read_bytes() == two.read_bytes(), one.name


def test_grpc_module_imports_the_protos_package() -> None:
    source = (generate.PROTOS_DIR / "sampling_pb2_grpc.py").read_text()
    assert "from protos import sampling_pb2" in source
    from protos import sampling_pb2_grpc

    assert hasattr(sampling_pb2_grpc, "SamplingServiceStub")
    assert hasattr(sampling_pb2_grpc, "PeerServiceServicer")


def _descriptor(tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """Compile sampling.proto with source info (comments) into a descriptor."""
    out = tmp_path / "sampling.desc"
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{generate.REPO_ROOT}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            str(generate.REPO_ROOT / generate.PROTO_FILE),
        ]
    )
    assert status == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def test_every_declaration_has_a_comment(tmp_path: Path) -> None:
    proto = _descriptor(tmp_path)
    commented = {
        tuple(loc.path)
        for loc in proto.source_code_info.location
        if loc.leading_comments.strip() or loc.trailing_comments.strip()
    }
    missing = []
    for m, message in enumerate(proto.message_type):
        if (4, m) not in commented:
            missing.append(message.name)
        missing += [
            f"{message.name}.{f.name}"
            for i, f in enumerate(message.field)
            if (4, m, 2, i) not in commented
        ]
    for e, enum in enumerate(proto.enum_type):
        missing += [
            f"{enum.name}.{v.name}"
            for i, v in enumerate(enum.value)
            if (5, e, 2, i) not in commented
        ]
    for s, service in enumerate(proto.service):
        missing += [
            f"{service.name}.{r.name}"
            for i, r in enumerate(service.method)
            if (6, s, 2, i) not in commented
        ]
    assert not missing, f"undocumented in sampling.proto: {missing}"


def test_wire_contract_shape(tmp_path: Path) -> None:
    proto = _descriptor(tmp_path)
    assert proto.package == "graphfeed.v1"
    methods = {
        service.name: {(m.name, m.server_streaming) for m in service.method}
        for service in proto.service
    }
    assert methods == {
        "SamplingService": {("GetClusterInfo", False), ("LookupNodes", False), ("StreamMinibatches", True),
                            ("StreamHotNodes", True)},
        "PeerService": {("SampleNeighbors", True), ("FetchNodeData", True), ("FetchEdgeData", True),
                        ("HasEdges", False)},
        "NodeTensorService": {("CreateNodeTensor", False), ("FindNodeTensor", False), ("ReadRows", True),
                              ("WriteRows", False), ("PushGradients", False), ("SnapshotNodeTensors", False),
                              ("RestoreNodeTensors", False), ("DropNodeTensor", False)},
    }
