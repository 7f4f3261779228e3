"""The cluster file of ``deploy/launch.py``: its model and its validation.

``load_cluster`` reads a YAML file with the safe loader and ``parse_cluster`` checks it,
raising :class:`ClusterError` with a message that names the field (``servers[1].port:
duplicate address ...``). See ``deploy/cluster.example.yaml`` for the file.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

_TOP_KEYS = frozenset({"ssh", "python", "workdir", "log_dir", "partition_dir", "servers",
                       "server_args", "trainers", "security"})
#: Keys of ``security:``, and the flags the launcher sets from them.
_SECURITY_KEYS = frozenset({"token_file", "tls_ca", "tls_cert", "tls_key", "insecure"})
#: The token's file on every node, under ``log_dir``.
REMOTE_TOKEN = "graphfeed.token"
_SSH_KEYS = frozenset({"user", "port", "identity_file", "options"})
_SERVER_KEYS = frozenset({"host", "port", "partition", "device"})
_TRAINER_KEYS = frozenset({"hosts", "gpus_per_host", "master_port", "args"})
_DEVICES = ("auto", "cpu", "cuda")
#: Trainer flags the launcher sets itself.
_RESERVED_TRAINER_ARGS = frozenset({"servers"}) | _SECURITY_KEYS
#: Server flags the launcher sets itself (``device``: per server, ``servers[].device``).
_RESERVED_SERVER_ARGS = frozenset({"partition", "partition_dir", "listen", "peers", "cluster",
                                   "device"}) | _SECURITY_KEYS


class ClusterError(ValueError):
    """The cluster file is invalid; the message names the field."""


@dataclass(frozen=True)
class SshConfig:
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerSpec:
    host: str
    port: int
    partition: int
    device: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class TrainerSpec:
    hosts: tuple[str, ...]
    gpus_per_host: int
    master_port: int
    args: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class SecuritySpec:
    """How the cluster's servers and trainers authenticate (``security:``)."""

    #: This machine's file holding the cluster's bearer token (made at the first start
    #: when missing); None: no token.
    token_file: Path | None
    #: Mutual TLS: the files on the nodes (``{host}``: the node's host name); None: no TLS.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Serve without TLS or a token (servers get ``--insecure``).
    insecure: bool = False

    def files(self, host: str) -> list[str]:
        """The TLS flags of a process on ``host``."""
        out: list[str] = []
        for flag, value in (("--tls-ca", self.tls_ca), ("--tls-cert", self.tls_cert),
                            ("--tls-key", self.tls_key)):
            if value is not None:
                out += [flag, value.replace("{host}", host)]
        return out


@dataclass(frozen=True)
class Cluster:
    ssh: SshConfig
    python: str
    workdir: str
    log_dir: str
    partition_dir: str
    servers: tuple[ServerSpec, ...]  # sorted by partition
    trainers: TrainerSpec | None
    #: ``sampling_server`` flags every server gets (``structure: full`` -> ``--structure full``).
    server_args: tuple[tuple[str, Any], ...] = ()
    #: Token and TLS of the servers and trainers.
    security: SecuritySpec = SecuritySpec(token_file=Path("graphfeed.token"))

    @property
    def remote_token(self) -> str | None:
        """The token's file on every node (None: no token)."""
        return None if self.security.token_file is None else \
            posixpath.join(self.log_path, REMOTE_TOKEN)

    @property
    def log_path(self) -> str:
        """``log_dir`` as an absolute remote path (relative ones are under ``workdir``)."""
        return posixpath.join(self.workdir, self.log_dir)

    @property
    def peers(self) -> str:
        return ",".join(s.address for s in self.servers)





def _fail(field: str, message: str) -> NoReturn:
    raise ClusterError(f"{field}: {message}")


def _find_passwords(obj: object, where: str) -> None:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            field = f"{where}.{key}" if where else str(key)
            if "password" in str(key).lower():
                _fail(field, "passwords are not allowed; use an ssh key or agent (ssh runs with "
                      "BatchMode=yes)")
            _find_passwords(value, field)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _find_passwords(value, f"{where}[{i}]")


def _check_keys(obj: object, allowed: frozenset[str], field: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        _fail(field, f"expected a mapping, got {obj!r}")
    unknown = sorted(set(map(str, obj)) - allowed)
    if unknown:
        _fail(field, f"unknown keys {unknown}; expected some of {sorted(allowed)}")
    return obj


def _str(obj: Mapping[str, Any], key: str, field: str, required: bool = True) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        _fail(field, f"expected a non-empty string, got {value!r}")
    return value


def _int(value: object, field: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        _fail(field, f"expected an integer in {low}..{high}, got {value!r}")
    return value


def _port(value: object, field: str) -> int:
    return _int(value, field, 1, 65535)


def _parse_ssh(obj: object) -> SshConfig:
    ssh = _check_keys({} if obj is None else obj, _SSH_KEYS, "ssh")
    options = ssh.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) and o for o in options):
        _fail("ssh.options", f"expected a list of 'Key=value' strings, got {options!r}")
    for i, option in enumerate(options):
        if option.replace(" ", "").lower().startswith("batchmode="):
            _fail(f"ssh.options[{i}]", "BatchMode is always yes; remove this option")
    return SshConfig(
        user=_str(ssh, "user", "ssh.user", required=False),
        port=_port(ssh.get("port", 22), "ssh.port"),
        identity_file=_str(ssh, "identity_file", "ssh.identity_file", required=False),
        options=tuple(options),
    )


def _parse_server(obj: object, i: int) -> ServerSpec:
    field = f"servers[{i}]"
    entry = _check_keys(obj, _SERVER_KEYS, field)
    for key in ("host", "port", "partition"):
        if key not in entry:
            _fail(f"{field}.{key}", "missing")
    device = _str(entry, "device", f"{field}.device", required=False)
    if device is not None and device not in _DEVICES:
        _fail(f"{field}.device", f"expected one of {list(_DEVICES)}, got {device!r}")
    return ServerSpec(
        host=str(_str(entry, "host", f"{field}.host")),
        port=_port(entry["port"], f"{field}.port"),
        partition=_int(entry["partition"], f"{field}.partition", 0, 1 << 30),
        device=device,
    )


def _parse_servers(obj: object) -> tuple[ServerSpec, ...]:
    if not isinstance(obj, list) or not obj:
        _fail("servers", f"expected a non-empty list of {{host, port, partition}}, got {obj!r}")
    servers = [_parse_server(entry, i) for i, entry in enumerate(obj)]
    seen: dict[int, int] = {}
    addresses: dict[str, int] = {}
    for i, server in enumerate(servers):
        if server.partition in seen:
            _fail(f"servers[{i}].partition",
                  f"duplicate partition {server.partition} (also servers[{seen[server.partition]}])")
        seen[server.partition] = i
        if server.address in addresses:
            _fail(f"servers[{i}].port",
                  f"duplicate address {server.address} (also servers[{addresses[server.address]}])")
        addresses[server.address] = i
    missing = sorted(set(range(len(servers))) - set(seen))
    if missing:
        _fail("servers", f"partitions must be 0..{len(servers) - 1} exactly once; "
              f"missing {missing}, got {sorted(seen)}")
    return tuple(sorted(servers, key=lambda s: s.partition))


def _parse_flag_args(obj: object, field: str, reserved: frozenset[str],
                     why: str) -> tuple[tuple[str, Any], ...]:
    """A mapping of ``flag: value`` (snake_case or dashes) for a command line; the
    ``reserved`` flags are refused (``why`` says who sets them)."""
    args = {} if obj is None else obj
    if not isinstance(args, Mapping):
        _fail(field, f"expected a mapping of flag: value, got {args!r}")
    for key, value in args.items():
        name = str(key).replace("-", "_")
        if not name.replace("_", "").isalnum():
            _fail(f"{field}.{key}", "expected a flag name (letters, digits, '_' or '-')")
        if name in reserved:
            _fail(f"{field}.{key}", f"{why}; remove it")
        if not isinstance(value, str | int | float | bool | list) and value is not None:
            _fail(f"{field}.{key}", f"expected a scalar or list, got {value!r}")
    return tuple((str(k), v) for k, v in args.items())


def _parse_trainers(obj: object) -> TrainerSpec | None:
    if obj is None:
        return None
    trainers = _check_keys(obj, _TRAINER_KEYS, "trainers")
    hosts = trainers.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        _fail("trainers.hosts", f"expected a non-empty list of host names, got {hosts!r}")
    for i, host in enumerate(hosts):
        if not isinstance(host, str) or not host.strip():
            _fail(f"trainers.hosts[{i}]", f"expected a non-empty host name, got {host!r}")
    if len(set(hosts)) != len(hosts):
        _fail("trainers.hosts", f"duplicate hosts in {hosts}")
    for key in ("gpus_per_host", "master_port"):
        if key not in trainers:
            _fail(f"trainers.{key}", "missing")
    return TrainerSpec(
        hosts=tuple(hosts),
        gpus_per_host=_int(trainers["gpus_per_host"], "trainers.gpus_per_host", 1, 1024),
        master_port=_port(trainers["master_port"], "trainers.master_port"),
        args=_parse_flag_args(trainers.get("args"), "trainers.args", _RESERVED_TRAINER_ARGS,
                              "set by the launcher from 'servers' and 'security'"),
    )


def _parse_security(obj: object, default_token: Path) -> SecuritySpec:
    sec = _check_keys({} if obj is None else obj, _SECURITY_KEYS, "security")
    insecure = sec.get("insecure", False)
    if not isinstance(insecure, bool):
        _fail("security.insecure", f"expected true or false, got {insecure!r}")
    token: Path | None = default_token
    if "token_file" in sec:
        given = _str(sec, "token_file", "security.token_file", required=False)
        token = None if given is None else default_token.parent / Path(given).expanduser()
    if insecure:
        token = None
    tls = {key: _str(sec, key, f"security.{key}", required=False)
           for key in ("tls_ca", "tls_cert", "tls_key")}
    if (tls["tls_cert"] is None) != (tls["tls_key"] is None):
        _fail("security.tls_cert", "expected tls_cert and tls_key together")
    if tls["tls_cert"] is not None and tls["tls_ca"] is None:
        _fail("security.tls_ca", "expected the cluster's CA with tls_cert (mutual TLS)")
    return SecuritySpec(token_file=token, insecure=insecure, **tls)


def parse_cluster(obj: object, path: Path | None = None) -> Cluster:
    """Validate a loaded cluster file (read from ``path``, which places the default token
    file beside it); raises :class:`ClusterError` naming the field."""
    top = _check_keys(obj, _TOP_KEYS, "cluster file")
    _find_passwords(top, "")
    default_token = path.with_suffix(".token") if path is not None else Path("graphfeed.token")
    return Cluster(
        ssh=_parse_ssh(top.get("ssh")),
        python=str(_str(top, "python", "python")),
        workdir=str(_str(top, "workdir", "workdir")),
        log_dir=str(_str(top, "log_dir", "log_dir")),
        partition_dir=str(_str(top, "partition_dir", "partition_dir")),
        servers=_parse_servers(top.get("servers")),
        trainers=_parse_trainers(top.get("trainers")),
        server_args=_parse_flag_args(
            top.get("server_args"), "server_args", _RESERVED_SERVER_ARGS,
            "set by the launcher from 'partition_dir', 'servers' (device: per server) and "
            "'security'"),
        security=_parse_security(top.get("security"), default_token),
    )


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file (safe loader)."""
    p = Path(path)
    try:
        obj = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ClusterError(f"{p}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ClusterError(f"{p}: not valid YAML ({exc})") from exc
    try:
        return parse_cluster(obj, p)
    except ClusterError as exc:
        raise ClusterError(f"{p}: {exc}") from exc
