"""Build the graphfeed image offline and run deploy/docker-compose.yml for real with podman.

    python deploy/compose_test.py [--rebuild-base] [--keep] [--timeout 900]

`make compose-test` runs this as root on a machine with no Docker engine and no reachable
image registry. Every step is checked, and the script exits non-zero at the first failure
(podman-compose itself exits 0 even when containers fail):

1. host tools: podman, runc, debootstrap and the CNI dnsname plugin (installed with
   apt-get when missing; podman 4.3's CNI networks resolve container names only through
   that plugin); podman-compose comes from PyPI (the Makefile installs it into the project's venv).
   podman reads deploy/podman/containers.conf through CONTAINERS_CONF: runc, and ulimits
   under the machine's hard limits; nothing global is changed.
2. base image `localhost/graphfeed-base:bookworm`: `debootstrap --variant=minbase bookworm`
   with python3, python3-venv and libgomp1 (OpenMP, for Numba's concurrent ``omp``
   threading layer), then `podman import` (kept between runs); then, up front,
   one container must resolve another by name on a fresh podman network.
3. wheelhouse/: `pip wheel` of graphfeed's dependencies on the host (torch==2.13.0, CPU).
4. `podman build -f deploy/Dockerfile` from that base with that wheelhouse (offline).
5. `podman-compose up -d`; each server must resolve the other's service name; the
   servers' compose health checks are run by hand until both report SERVING (podman < 4.6
   runs health checks only under systemd, and podman-compose then starts the trainers
   without waiting for health: they wait for the servers themselves).
   Secure by default: a call without the cluster's token (which the compose `token` job
   made) gets UNAUTHENTICATED from each server, and the token file is the servers' user's
   alone (mode 600).
6. wait for the trainers; check every exit code, the test accuracy in the logs, the
   metrics in the `data` volume (world size 2, every seed once per epoch, identical
   parameters on both ranks), that both servers served both ranks and ran their kernels
   on Numba's ``omp`` threading layer; stop the servers
   (SIGTERM drain, exit 0); `down -v`. All container logs go to data/compose-test/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
CONTAINERS_CONF = REPO / "deploy" / "podman" / "containers.conf"
WORK = REPO / "data" / "compose-test"
WHEELHOUSE = REPO / "wheelhouse"
BASE_IMAGE = "localhost/graphfeed-base:bookworm"
IMAGE = "localhost/graphfeed:latest"
PROJECT = "graphfeed-compose-test"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What `make compose-test` needs on the host, as (Debian package, file it provides). Every
# package is checked by that file, so a machine where one was never installed gets it.
HOST_REQUIREMENTS = (
    ("podman", "/usr/bin/podman"),
    ("runc", "/usr/sbin/runc"),
    ("debootstrap", "/usr/sbin/debootstrap"),
    # podman 4.3's CNI network backend resolves compose service names only through this
    # plugin (it brings dnsmasq-base); without it the servers never find their peers.
    ("golang-github-containernetworking-plugin-dnsname", "/usr/lib/cni/dnsname"),
)
# Where podman 4.3 looks for CNI plugins (containers.conf's default cni_plugin_dirs).
CNI_PLUGIN_DIRS = ("/usr/local/libexec/cni", "/usr/libexec/cni", "/usr/local/lib/cni", "/usr/lib/cni",
                   "/opt/cni/bin")
DNS_CHECK_NETWORK = "graphfeed-dns-check"
TRAINERS = ("trainer0", "trainer1")
SERVERS = ("server0", "server1")
MIN_TEST_ACC = 0.5  # six classes: chance is 0.167
NUM_TRAIN = 1200  # training nodes of the `small` graph the compose partition job writes


class ComposeTestError(RuntimeError):
    pass


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def run(cmd: list[str], *, timeout: float, capture: bool = False, check: bool = True,
        log: Path | None = None, quiet: bool = False, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run one command with a deadline; its output goes to `log`, is captured, or is shown.

    Every command is echoed except `quiet` ones (inspections and polls)."""
    if not quiet:
        print("$ " + " ".join(cmd), flush=True)
    try:
        if log is not None:
            with log.open("w") as fh:
                proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                      timeout=timeout, **kw)  # type: ignore[call-overload]
        else:
            proc = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout,
                                  **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as exc:
        raise ComposeTestError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        detail = log.read_text()[-4000:] if log is not None else (proc.stderr or "")[-4000:]
        raise ComposeTestError(f"`{' '.join(cmd)}` exited {proc.returncode}\n{detail}")
    return proc


def podman(*args: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return run(["podman", *args], timeout=timeout, **kw)  # type: ignore[arg-type]


def podman_compose_exe() -> Path | None:
    """The venv's podman-compose (the pinned one), else one on PATH."""
    local = Path(sys.executable).with_name("podman-compose")
    if local.exists():
        return local
    found = shutil.which("podman-compose")
    return Path(found) if found else None


def compose(*args: str, timeout: float = 600, **kw: object) -> subprocess.CompletedProcess[str]:
    exe = podman_compose_exe()
    if exe is None:
        raise ComposeTestError("podman-compose is not installed: `make compose-test` installs it "
                               "(pip install podman-compose) into the project's venv")
    return run([str(exe), "-p", PROJECT, "-f", str(COMPOSE_FILE), *args], timeout=timeout,
               **kw)  # type: ignore[arg-type]


# --- 1. host tools ------------------------------------------------------------------------


def missing_host_packages() -> list[str]:
    return [pkg for pkg, path in HOST_REQUIREMENTS if not Path(path).exists()]


def purge_host_packages() -> None:
    """--fresh-host: remove what step 1 installs, so that this run installs it as a new machine would.

    A machine where a package was once installed by hand hides a missing install step;
    this brings the host back to where a fresh one starts (images and volumes stay)."""
    step("fresh host: purge the packages step 1 installs, and what only they pulled in")
    installed = [pkg for pkg, _ in HOST_REQUIREMENTS
                 if run(["dpkg-query", "-W", "-f", "${Status}", pkg], timeout=60, capture=True,
                        check=False, quiet=True).stdout.endswith(" installed")]
    if not installed:
        print("none of them is installed", flush=True)
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "purge", "-y", "-qq", "--autoremove", *installed], timeout=600, env=env,
        log=WORK / "logs" / "apt-purge.log")
    left = [pkg for pkg, path in HOST_REQUIREMENTS if Path(path).exists()]
    if left:
        raise ComposeTestError(f"--fresh-host: still present after the purge: {', '.join(left)}")


def ensure_host_tools() -> None:
    step("host tools: podman, runc, debootstrap, the CNI dnsname plugin, podman-compose")
    if os.geteuid() != 0:
        raise ComposeTestError("run as root: the images, volumes and networks are rootful podman's")
    missing = missing_host_packages()
    if missing:
        if shutil.which("apt-get") is None:
            raise ComposeTestError(f"missing {', '.join(missing)} and no apt-get to install them")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], timeout=600, env=env, log=WORK / "logs" / "apt.log")
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
            timeout=900, env=env, log=WORK / "logs" / "apt-install.log")
        still = missing_host_packages()
        if still:
            raise ComposeTestError(f"apt-get installed {', '.join(missing)}, yet these are still "
                                   f"missing: {', '.join(still)}")
    podman("--version")
    compose("--version", timeout=60)
    check_network_dns_backend()


def check_network_dns_backend() -> None:
    """The network backend podman uses must resolve container names, or say what is missing."""
    backend = podman("info", "--format", "{{.Host.NetworkBackend}}", capture=True,
                     quiet=True).stdout.strip()
    if backend == "netavark":
        if not any(Path(d, "aardvark-dns").exists() for d in ("/usr/lib/podman", "/usr/libexec/podman")):
            raise ComposeTestError("podman uses the netavark network backend but aardvark-dns is not "
                                   "installed: compose service names will not resolve "
                                   "(apt-get install aardvark-dns)")
    elif backend == "cni":
        if not any(Path(d, "dnsname").exists() for d in CNI_PLUGIN_DIRS):
            raise ComposeTestError("podman uses the CNI network backend but the dnsname plugin is not "
                                   f"in any of {', '.join(CNI_PLUGIN_DIRS)}: compose service names "
                                   "will not resolve (apt-get install "
                                   "golang-github-containernetworking-plugin-dnsname)")
    else:
        raise ComposeTestError(f"unknown podman network backend {backend!r}; expected cni or netavark")
    print(f"network backend {backend}, with container name resolution", flush=True)


def check_name_resolution(image: str) -> None:
    """Up front: one container resolves another by name on a fresh podman network."""
    step(f"container name resolution on a podman network ({image})")
    podman("network", "rm", "--force", DNS_CHECK_NETWORK, capture=True, check=False, quiet=True)
    podman("network", "create", DNS_CHECK_NETWORK, capture=True, quiet=True)
    target = f"{DNS_CHECK_NETWORK}-target"
    try:
        podman("run", "-d", "--rm", "--name", target, "--network", DNS_CHECK_NETWORK, image,
               "sleep", "60", capture=True, quiet=True)
        probe = podman("run", "--rm", "--network", DNS_CHECK_NETWORK, image, "getent", "hosts", target,
                       capture=True, check=False, timeout=60, quiet=True)
    finally:
        podman("rm", "--force", "--time", "0", target, capture=True, check=False, quiet=True)
        podman("network", "rm", "--force", DNS_CHECK_NETWORK, capture=True, check=False, quiet=True)
    if probe.returncode != 0:
        dns = podman("network", "inspect", "--format", "{{.DNSEnabled}}", "podman", capture=True,
                     check=False, quiet=True).stdout.strip()
        raise ComposeTestError(f"a container cannot resolve another one by name ({target}) on a podman "
                               f"network (DNS enabled on the default network: {dns or 'unknown'}): "
                               "compose service names would not resolve either. With podman's CNI "
                               "backend install golang-github-containernetworking-plugin-dnsname; "
                               "with netavark, aardvark-dns")
    print(f"resolved {target}: {probe.stdout.split()[0]}", flush=True)


# --- 2. base image ------------------------------------------------------------------------


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False, quiet=True).returncode == 0


def ensure_base_image(rebuild: bool) -> None:
    step(f"base image {BASE_IMAGE} (debootstrap --variant=minbase {SUITE} + python3)")
    if image_exists(BASE_IMAGE) and not rebuild:
        probe = "ldconfig -p | grep 'libgomp\\.so\\.1 ' >/dev/null"  # grep reads it all: no SIGPIPE
        if podman("run", "--rm", BASE_IMAGE, "sh", "-c", probe, check=False, quiet=True).returncode == 0:
            print("already there; --rebuild-base makes it anew", flush=True)
            return
        print("already there but without libgomp1 (an older base): making it anew", flush=True)
    rootfs = WORK / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    t0 = time.perf_counter()
    # libgomp1: OpenMP, so that Numba's parallel kernels run concurrently (the omp layer)
    run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,libgomp1",
         SUITE, str(rootfs), MIRROR], timeout=1200, log=WORK / "logs" / "debootstrap.log")
    # Nothing from the host's apt caches or the bootstrap's downloads goes into the image.
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (rootfs / junk).glob("*"):
            if f.is_file():
                f.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."],
                           stdout=subprocess.PIPE)
    try:
        run(["podman", "import", "--change", "CMD [\"/bin/bash\"]", "-", BASE_IMAGE],
            timeout=600, stdin=tar.stdout, capture=True)
    finally:
        if tar.stdout is not None:
            tar.stdout.close()
        if tar.wait(timeout=60) != 0:
            raise ComposeTestError("tar of the debootstrap root failed")
    shutil.rmtree(rootfs)
    version = podman("run", "--rm", BASE_IMAGE, "python3", "--version", capture=True).stdout.strip()
    print(f"base image ready in {time.perf_counter() - t0:.0f} s: {version}", flush=True)


# --- 3. wheelhouse ------------------------------------------------------------------------


def requirements() -> list[str]:
    """graphfeed's dependencies and its build backend, from pyproject.toml."""
    with (REPO / "pyproject.toml").open("rb") as fh:
        meta = tomllib.load(fh)
    return [*meta["project"]["dependencies"], *meta["build-system"]["requires"]]


def build_wheelhouse() -> None:
    step("wheelhouse/: graphfeed's dependencies as wheels, made on the host")
    WHEELHOUSE.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    # The build backend too, so that the image's `pip install --no-index` can build graphfeed.
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
         "--wheel-dir", str(WHEELHOUSE), *requirements()],
        timeout=1800, log=WORK / "logs" / "wheelhouse.log")
    wheels = sorted(WHEELHOUSE.glob("*.whl"))
    if not any(w.name.startswith("torch-2.13.0") for w in wheels):
        raise ComposeTestError(f"no torch 2.13.0 wheel in {WHEELHOUSE}")
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.0f} MiB, in {time.perf_counter() - t0:.0f} s", flush=True)


# --- 4. image -----------------------------------------------------------------------------


def build_image() -> None:
    step(f"image {IMAGE} from deploy/Dockerfile (offline, from the wheelhouse)")
    t0 = time.perf_counter()
    # --no-cache: the install step reads the sources through a bind mount, which the
    # layer cache cannot see change.
    podman("build", "--no-cache", "-f", str(REPO / "deploy" / "Dockerfile"),
           "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"WHEELHOUSE={WHEELHOUSE.name}",
           "-t", IMAGE, str(REPO), timeout=1800, log=WORK / "logs" / "build.log")
    size = podman("image", "inspect", "--format", "{{.Size}}", IMAGE, capture=True,
                  quiet=True).stdout.strip()
    # A rebuild leaves the previous image untagged; do not let them pile up.
    podman("image", "prune", "--force", capture=True, check=False)
    print(f"built in {time.perf_counter() - t0:.0f} s, {int(size) / 2**30:.2f} GiB", flush=True)


# --- 5/6. the cluster ---------------------------------------------------------------------


def containers() -> dict[str, dict[str, object]]:
    """service name -> podman's record of its container, for this compose project."""
    out = podman("ps", "-a", "--format", "json", "--filter",
                 f"label=com.docker.compose.project={PROJECT}", capture=True, quiet=True).stdout
    found: dict[str, dict[str, object]] = {}
    for c in json.loads(out or "[]"):
        service = c.get("Labels", {}).get("com.docker.compose.service")
        if service:
            found[service] = c
    return found


def _name(record: dict[str, object]) -> str:
    names = record["Names"]
    return str(names[0] if isinstance(names, list) else names)


def container_name(service: str) -> str:
    c = containers().get(service)
    if c is None:
        raise ComposeTestError(f"no container for service {service!r}: compose did not create it")
    return _name(c)


def exit_code(service: str) -> int:
    out = podman("inspect", "--format", "{{.State.ExitCode}}", container_name(service),
                 capture=True, quiet=True).stdout
    return int(out.strip())


def _logs_of(name: str) -> str:
    proc = podman("logs", name, capture=True, check=False, quiet=True)
    return proc.stdout + proc.stderr


def logs(service: str) -> str:
    return _logs_of(container_name(service))


def save_logs() -> None:
    for service, record in containers().items():
        (WORK / "logs" / f"{service}.log").write_text(_logs_of(_name(record)))


def check_service_names(deadline: float) -> None:
    """Each server resolves the other by its compose service name (its peers' addresses)."""
    step("service names resolve inside the compose network")
    for service in SERVERS:
        name = container_name(service)
        for other in SERVERS:
            if other == service:
                continue
            while True:
                probe = podman("exec", name, "getent", "hosts", other, capture=True, check=False,
                               timeout=30, quiet=True)
                if probe.returncode == 0:
                    print(f"{service}: {other} -> {probe.stdout.split()[0]}", flush=True)
                    break
                if time.monotonic() > deadline:
                    network = f"{PROJECT}_default"
                    dns = podman("network", "inspect", "--format", "{{.DNSEnabled}}", network,
                                 capture=True, check=False, quiet=True).stdout.strip()
                    raise ComposeTestError(
                        f"{service} cannot resolve the service name {other!r} (getent exit "
                        f"{probe.returncode}; {network} DNS enabled: {dns or 'unknown'}): the servers "
                        "would wait for their peers forever. podman's CNI backend needs the dnsname "
                        "plugin (golang-github-containernetworking-plugin-dnsname) when the network "
                        "is created")
                time.sleep(1)


def drop_network_without_dns() -> None:
    """A compose network made before the dnsname plugin was installed never gets DNS."""
    network = f"{PROJECT}_default"
    dns = podman("network", "inspect", "--format", "{{.DNSEnabled}}", network, capture=True,
                 check=False, quiet=True)
    if dns.returncode == 0 and dns.stdout.strip() != "true":
        print(f"removing {network}: it was created without DNS", flush=True)
        podman("network", "rm", "--force", network, capture=True, check=False)


def wait_healthy(service: str, deadline: float) -> float:
    """Run the service's compose health check until it passes; seconds it took."""
    name = container_name(service)
    t0 = time.perf_counter()
    while time.monotonic() < deadline:
        state = podman("inspect", "--format", "{{.State.Status}}", name, capture=True,
                       quiet=True).stdout.strip()
        if state not in {"running", "created", "configured", "initialized"}:
            raise ComposeTestError(f"{service} is {state} (exit code {exit_code(service)}) before "
                                   f"it became healthy:\n{logs(service)[-3000:]}")
        if podman("healthcheck", "run", name, capture=True, check=False, timeout=30,
                  quiet=True).returncode == 0:
            return time.perf_counter() - t0
        time.sleep(2)
    raise ComposeTestError(f"{service} not healthy (SERVING) in time:\n{logs(service)[-3000:]}")


# What a stranger inside the compose network gets: the status of a call without the token.
STRANGER_CALL = """
import grpc, sys
from protos import sampling_pb2 as pb, sampling_pb2_grpc as pb_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=10)
        print("OK")
    except grpc.RpcError as exc:
        print(exc.code().name)
"""


def check_credentials_required() -> None:
    """Secure by default: each server refuses a call without the cluster's token, and the
    token file the `token` job made is readable by its owner only."""
    step("servers refuse a caller without the cluster's token")
    for service in SERVERS:
        other = SERVERS[1 - SERVERS.index(service)]
        got = podman("exec", container_name(other), "python", "-c", STRANGER_CALL, f"{service}:50051",
                     capture=True, timeout=60, quiet=True).stdout.strip()
        if got != "UNAUTHENTICATED":
            raise ComposeTestError(f"a call to {service} without the token got {got or 'nothing'}, "
                                   "expected UNAUTHENTICATED")
        print(f"{service}: a call without the token gets UNAUTHENTICATED", flush=True)
    mode = podman("exec", container_name(SERVERS[0]), "stat", "-c", "%a %U", "/var/lib/graphfeed/token",
                  capture=True, quiet=True).stdout.strip()
    if mode != "600 graphfeed":
        raise ComposeTestError(f"the token file is {mode!r} (mode, owner), expected '600 graphfeed'")


def wait_exited(service: str, deadline: float) -> int:
    name = container_name(service)
    remaining = max(1.0, deadline - time.monotonic())
    try:
        out = podman("wait", name, capture=True, timeout=remaining, quiet=True).stdout
    except ComposeTestError as exc:
        raise ComposeTestError(f"{service} still running after the deadline:\n"
                               f"{logs(service)[-3000:]}") from exc
    return int(out.strip().splitlines()[-1])


def check_cluster(timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    report: dict[str, object] = {}
    step("compose up -d")
    t0 = time.perf_counter()
    compose("up", "-d", timeout=timeout, log=WORK / "logs" / "compose-up.log")
    check_service_names(deadline=min(deadline, time.monotonic() + 60))

    step("partition job")
    code = wait_exited("partition", deadline)
    if code != 0:
        raise ComposeTestError(f"partition exited {code}:\n{logs('partition')[-3000:]}")
    runs = logs("partition")
    wrote, skipped = runs.count("written to /data/"), runs.count("nothing to do")
    if wrote != 1:
        raise ComposeTestError(f"the partition job wrote the partition {wrote} times, expected "
                               f"once:\n{runs[-3000:]}")
    print(f"partition exited 0 (wrote the partition once; {skipped} later runs left it alone)",
          flush=True)

    step("servers: compose health checks (grpc.health.v1) until SERVING")
    for service in SERVERS:
        took = wait_healthy(service, deadline)
        print(f"{service}: SERVING (health check passed after {took:.1f} s of polling)", flush=True)

    check_credentials_required()

    step("trainers: one DDP job across two containers")
    codes = {service: wait_exited(service, deadline) for service in TRAINERS}
    report["train_seconds"] = round(time.perf_counter() - t0, 1)
    bad = {s: c for s, c in codes.items() if c != 0}
    if bad:
        raise ComposeTestError("trainers failed: " + ", ".join(f"{s} exited {c}" for s, c in bad.items())
                               + "".join(f"\n--- {s}\n{logs(s)[-3000:]}" for s in bad))
    print("both trainers exited 0", flush=True)

    match = re.search(r"test acc (\d+\.\d+)", logs("trainer0"))
    if match is None:
        raise ComposeTestError(f"no `test acc` in trainer0's log:\n{logs('trainer0')[-3000:]}")
    test_acc = float(match.group(1))
    report["test_acc"] = test_acc
    print(f"trainer0 log: test acc {test_acc:.4f}", flush=True)
    if test_acc < MIN_TEST_ACC:
        raise ComposeTestError(f"test accuracy {test_acc} is below {MIN_TEST_ACC}")

    volume = f"{PROJECT}_data"
    mountpoint = podman("volume", "inspect", "--format", "{{.Mountpoint}}", volume,
                        capture=True, quiet=True).stdout.strip()
    metrics = json.loads((Path(mountpoint) / "metrics.json").read_text())
    fingerprints = metrics["param_fingerprints"]
    problems = []
    if metrics["world_size"] != 2:
        problems.append(f"world_size {metrics['world_size']}, expected 2")
    if len(set(fingerprints)) != 1 or len(fingerprints) != 2:
        problems.append(f"parameters differ across ranks: {fingerprints}")
    seeds = [e["seeds"] for e in metrics["epochs"]]
    if not seeds or any(s != NUM_TRAIN for s in seeds):
        problems.append(f"seeds per epoch {seeds}, expected {NUM_TRAIN} each")
    if abs(metrics["test_acc"] - test_acc) > 1e-3:
        problems.append(f"metrics test_acc {metrics['test_acc']} != log's {test_acc}")
    for service in SERVERS:
        text = logs(service)
        for rank in (0, 1):
            if f"rank={rank}/2" not in text:
                problems.append(f"{service} never streamed to rank {rank}")
        layer = re.search(r"Numba threading layer '(\w+)'", text)
        if layer is None or layer.group(1) == "workqueue":  # parallel kernels one at a time
            problems.append(f"{service} runs its parallel kernels on Numba's "
                            f"{layer.group(1) if layer else 'unknown'} threading layer, "
                            f"expected omp (the image's libgomp1)")
    if problems:
        raise ComposeTestError("; ".join(problems))
    print(f"metrics.json: {len(seeds)} epochs of {NUM_TRAIN} seeds, identical parameters on both "
          f"ranks; both servers streamed to both ranks", flush=True)

    step("stop the servers (SIGTERM, drain)")
    compose("stop", *SERVERS, timeout=120, capture=True)
    stops = {service: exit_code(service) for service in SERVERS}
    if any(stops.values()):
        raise ComposeTestError(f"servers did not exit 0 on SIGTERM: {stops}")
    print("both servers exited 0", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rebuild-base", action="store_true", help="make the debootstrap base anew")
    p.add_argument("--skip-build", action="store_true",
                   help=f"use the existing {IMAGE} (no wheelhouse, no image build)")
    p.add_argument("--fresh-host", action="store_true",
                   help="purge the host packages first, so the run installs them as on a new machine")
    p.add_argument("--keep", action="store_true", help="leave the containers and volume in place")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the cluster run")
    args = p.parse_args(argv)

    os.environ["CONTAINERS_CONF"] = str(CONTAINERS_CONF)
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ok = False
    try:
        if args.fresh_host:
            if os.geteuid() != 0:
                raise ComposeTestError("--fresh-host purges host packages: run as root")
            purge_host_packages()
        ensure_host_tools()
        ensure_base_image(args.rebuild_base)
        check_name_resolution(BASE_IMAGE)
        if not args.skip_build:
            build_wheelhouse()
            build_image()
        elif not image_exists(IMAGE):
            raise ComposeTestError(f"--skip-build, but there is no {IMAGE}")
        compose("down", "-v", timeout=180, capture=True, check=False)  # leftovers of a run
        drop_network_without_dns()
        report = check_cluster(args.timeout)
        ok = True
    except ComposeTestError as exc:
        print(f"\ncompose-test FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        try:
            save_logs()
            if not args.keep:
                compose("down", "-v", timeout=180, capture=True, check=False)
        except ComposeTestError as exc:  # cleanup trouble must not hide the verdict
            print(f"cleanup: {exc}", file=sys.stderr, flush=True)
    print(f"container logs: {WORK / 'logs'}", flush=True)
    if not ok:
        return 1
    print(f"\ncompose-test passed in {time.perf_counter() - t0:.0f} s: test acc "
          f"{report['test_acc']:.4f}, cluster up to trainers done {report['train_seconds']} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
