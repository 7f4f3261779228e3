"""Hosts in network namespaces on one machine, joined by links that ``tc`` shapes.

Each host is a namespace with one interface, ``eth0``, whose other end is a port of a
bridge in a switch namespace: a star, as hosts on one top-of-rack switch. A link shape
(:class:`LinkShape`) is applied to both directions of every host's link: a token bucket
(``tbf``) on the host's ``eth0`` (what it sends) and on its switch port (what it
receives), so each host has a full-duplex NIC of that rate, and, where the kernel has
``netem``, a fixed one-way delay under the bucket.

Planning (:func:`plan_topology`, :func:`shape_commands`) is pure and needs no root;
:class:`Network` runs the plan and removes every namespace it made on close.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

log = logging.getLogger("bench.netns")

#: Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
IFNAME_MAX = 15
_NAME = re.compile(r"^[a-z][a-z0-9]*$")
_TAG = re.compile(r"^[a-z][a-z0-9-]*$")


class NetnsError(RuntimeError):
    """The namespaces or the shaping could not be set up; says which command failed."""


@dataclass(frozen=True)
class Host:
    """One host of the topology."""

    #: Its name in the benchmark ("server0", "trainer1").
    name: str
    #: The network namespace it runs in.
    namespace: str
    #: Its IPv4 address on the switch's subnet.
    address: str
    #: Its port (the veth end) in the switch namespace.
    port: str


@dataclass(frozen=True)
class Topology:
    """Hosts on one switch; every name a namespace or an interface gets."""

    #: Prefix of every namespace name (one run's tag).
    tag: str
    #: The switch's namespace (it holds the bridge ``br0``).
    switch: str
    #: The hosts, in the order given.
    hosts: tuple[Host, ...]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"host: expected one of {[h.name for h in self.hosts]}, got {name!r}")

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the topology, switch first."""
        return [self.switch, *(h.namespace for h in self.hosts)]


@dataclass(frozen=True)
class LinkShape:
    """The rate and the one-way delay of every host's link."""

    #: Rate of each direction of a link, bits per second.
    rate_bits: float
    #: One-way delay added by netem, microseconds (0: none).
    delay_us: float = 0.0

    @property
    def label(self) -> str:
        gbit = self.rate_bits / 1e9
        rate = f"{gbit:g} Gbit/s" if gbit >= 1 else f"{self.rate_bits / 1e6:g} Mbit/s"
        return rate + (f" + {self.delay_us:g} us" if self.delay_us else "")

    @property
    def rate_bytes(self) -> float:
        return self.rate_bits / 8

    def burst_bytes(self) -> int:
        """The token bucket's depth: half a millisecond of the rate, at least 128 KiB (more
        than one 64 KiB GSO packet, which tbf would otherwise split or drop)."""
        return max(int(self.rate_bytes * 0.0005), 128 << 10)


def parse_rate(text: str) -> float:
    """``"10gbit"``, ``"25G"``, ``"500mbit"`` or a bare number of Gbit/s -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([gmk]?)(bit|b)?(/s|ps)?\s*", text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"rate: expected a positive rate such as 10gbit, 25G or 500mbit, got {text!r}")
    scale = {"g": 1e9, "m": 1e6, "k": 1e3, "": 1e9}[m.group(2)]
    return float(m.group(1)) * scale


def plan_topology(names: Sequence[str], tag: str, subnet: str = "10.231.78") -> Topology:
    """Hosts ``names`` (lower-case letters and digits) on ``subnet``.1, .2, ...; namespaces
    ``<tag>-<name>`` and ``<tag>-sw``."""
    if not _TAG.match(tag) or len(tag) > 24:
        raise ValueError(f"tag: expected lower-case letters, digits and '-' (at most 24), got {tag!r}")
    octets = subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
        raise ValueError(f"subnet: expected three octets such as 10.231.78, got {subnet!r}")
    if not names or len(set(names)) != len(names) or len(names) > 250:
        raise ValueError(f"names: expected 1 to 250 distinct host names, got {list(names)}")
    hosts = []
    for i, name in enumerate(names):
        port = f"p{name}"
        if not _NAME.match(name) or len(port) > IFNAME_MAX:
            raise ValueError(f"names: expected lower-case letters and digits, at most {IFNAME_MAX - 1} "
                             f"characters, got {name!r}")
        hosts.append(Host(name, f"{tag}-{name}", f"{subnet}.{i + 1}", port))
    return Topology(tag, f"{tag}-sw", tuple(hosts))


def setup_commands(topo: Topology) -> list[list[str]]:
    """The ``ip`` commands that build ``topo`` (run in the root namespace, in order)."""
    sw = topo.switch
    cmds = [["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for h in topo.hosts:
        ns = h.namespace
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "link", "add", h.port, "netns", sw, "type", "veth", "peer", "name", "eth0",
                  "netns", ns],
                 ["ip", "-n", sw, "link", "set", h.port, "master", "br0", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{h.address}/24", "dev", "eth0"],
                 ["ip", "-n", ns, "link", "set", "eth0", "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"]]
    return cmds


def shape_commands(topo: Topology, shape: LinkShape | None, netem: bool) -> list[list[str]]:
    """The ``tc`` commands that give every link ``shape`` (None: unshaped), both directions:
    each host's ``eth0`` and its switch port. ``netem``: the kernel has netem (the delay
    is left out otherwise)."""
    cmds = []
    for h in topo.hosts:
        for ns, dev in ((h.namespace, "eth0"), (topo.switch, h.port)):
            if shape is None:
                cmds.append(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
                continue
            cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
                         "rate", f"{int(shape.rate_bits)}bit", "burst", str(shape.burst_bytes()),
                         "latency", "20ms"])
            if netem and shape.delay_us > 0:
                cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle",
                             "10:", "netem", "delay", f"{shape.delay_us:g}us", "limit", "100000"])
    return cmds


def why_not_root() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return ("needs root: it creates network namespaces (ip netns) and shapes links (tc); "
                "run it with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool} command (iproute2) is not installed"
    return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


class Network:
    """The namespaces of ``topo``, built on enter and removed on exit (also after errors);
    :meth:`close` may be called any number of times."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._made: list[str] = []
        #: Whether this kernel has netem (probed on enter).
        self.netem = False

    def __enter__(self) -> Network:
        reason = why_not_root()
        if reason:
            raise NetnsError(reason)
        try:
            for cmd in setup_commands(self.topo):
                if cmd[:3] == ["ip", "netns", "add"]:
                    self._made.append(cmd[3])
                _run(cmd)
            self.netem = self._probe_netem()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _probe_netem(self) -> bool:
        dev = self.topo.hosts[0].port
        probe = ["tc", "-n", self.topo.switch, "qdisc", "replace", "dev", dev, "root", "netem",
                 "delay", "1us"]
        ok = _run(probe, check=False).returncode == 0
        _run(["tc", "-n", self.topo.switch, "qdisc", "del", "dev", dev, "root"], check=False)
        if not ok:
            log.warning("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): links get their "
                        "rate but no added delay")
        return ok

    def shape(self, shape: LinkShape | None) -> None:
        """Give every link ``shape`` (None: remove the shaping)."""
        for cmd in shape_commands(self.topo, shape, self.netem):
            _run(cmd, check=shape is not None)  # deleting a qdisc that is not there is fine

    def qdisc_stats(self, host: str) -> str:
        """``tc -s qdisc`` of a host's ``eth0`` (what shows that the shaping works)."""
        h = self.topo.host(host)
        return _run(["tc", "-s", "-n", h.namespace, "qdisc", "show", "dev", "eth0"]).stdout

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(sent, received) bytes of a host's ``eth0`` since it was made: what its link
        carried both ways, every process of the host and the kernel's own traffic."""
        h = self.topo.host(host)
        out = _run(["ip", "-n", h.namespace, "-s", "-j", "link", "show", "dev", "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def popen(self, host: str, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        """Start ``cmd`` inside ``host``'s namespace (``ip netns exec`` execs it: the pid is
        the command's own)."""
        return subprocess.Popen(["ip", "netns", "exec", self.topo.host(host).namespace, *cmd],
                                text=True, **kw)

    def close(self) -> None:
        for ns in reversed(self._made):
            done = _run(["ip", "netns", "del", ns], check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                log.warning("could not remove namespace %s: %s", ns, done.stderr.strip())
        self._made.clear()


def stale_namespaces(prefix: str, listing: str) -> list[str]:
    """Namespaces in ``ip netns list`` output ``listing`` named ``<prefix><pid>-...`` whose
    process ``pid`` is gone (left by a run that was killed with SIGKILL)."""
    stale = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-[a-z0-9]+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            stale.append(name)
    return stale


def remove_stale(prefix: str) -> list[str]:
    """Remove the namespaces :func:`stale_namespaces` finds; their names."""
    listing = _run(["ip", "netns", "list"], check=False).stdout
    stale = stale_namespaces(prefix, listing)
    for ns in stale:
        _run(["ip", "netns", "del", ns], check=False)
    return stale
