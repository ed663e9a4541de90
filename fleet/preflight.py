"""Preflight: what a node has, read in one round trip, and the checks that stop a bring-up early.

Pure parsers (nvidia-smi CSV, /proc/meminfo, /proc/mounts, /proc/net/tcp, df) are kept
apart from `gather`, the one function that touches the node, so every parser is tested on
real text without a machine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fleet.config import FleetConfig, NodeConfig
from fleet.errors import AuthFailed, FleetError, HostKeyError
from fleet.node import Node

NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version",
    "--format=csv,noheader,nounits",
]

# A venv, or weights read at start-up, on one of these makes imports and loads crawl
# (every import is a metadata round trip to a remote server). Matched exactly or by prefix.
NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "9p", "ceph", "glusterfs", "gpfs",
    "beegfs", "afs", "davfs", "ncpfs", "orangefs", "ocfs2", "gfs2", "wekafs", "virtiofs",
    "juicefs", "alluxio", "pvfs2", "panfs",
}
NETWORK_FS_PREFIXES = ("fuse.", "fuse", "nfs")
# fuse filesystems that are local disks, not remote object stores
LOCAL_FUSE = {"fuse.overlay", "fuse-overlayfs", "fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    driver_version: str


@dataclass(frozen=True)
class Mount:
    device: str
    mountpoint: str
    fstype: str

    @property
    def network(self) -> bool:
        return is_network_fs(self.fstype)


@dataclass
class PathInfo:
    role: str            # venv | model_source | ramdisk | workdir | staging_target
    path: str
    resolved: str
    exists: bool
    fstype: str
    mountpoint: str
    network: bool
    avail_bytes: int | None
    size_bytes: int | None = None   # du of the path (model source only)


@dataclass
class Check:
    name: str
    ok: bool
    hard: bool
    detail: str
    remedy: str = ""


@dataclass
class NodeReport:
    node: str
    host: str
    reachable: bool
    seconds: float = 0.0
    error: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    nvidia_smi: str = "absent"  # ok | absent | error: <text>
    cpu_count: int | None = None
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    paths: list[PathInfo] = field(default_factory=list)
    ports: dict[int, bool] = field(default_factory=dict)   # port -> free
    listening: set[int] = field(default_factory=set, repr=False)   # every port listening on the node
    python: str | None = None
    uv: str | None = None
    command_s: float | None = None   # the quickest of a few no-op commands: a round trip plus the shell's start
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reachable and not any(c.hard and not c.ok for c in self.checks)

    def path(self, role: str) -> PathInfo | None:
        return next((p for p in self.paths if p.role == role), None)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.hard and not c.ok]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("listening")   # internal: for suggesting free ports
        d["ok"] = self.ok
        d["ports"] = [{"port": p, "free": free} for p, free in sorted(self.ports.items())]
        return d


# -- pure parsers ----------------------------------------------------------------------

def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,name,uuid,memory.*,driver_version --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 7 or not cells[0].isdigit():
            continue
        # a GPU name could hold a comma; the last five cells are fixed
        name = ",".join(cells[1:-5]).strip()
        uuid, total, used, free, driver = cells[-5:]
        gpus.append(Gpu(int(cells[0]), name, uuid, _int(total), _int(used), _int(free), driver))
    return gpus


def _int(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        return -1  # "[N/A]" on some MIG / vGPU setups


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo."""
    vals: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            vals[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return vals.get("MemTotal"), vals.get("MemAvailable")


def _unescape_mount(field_: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal
    return (field_.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\"))


def parse_mounts(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            mounts.append(Mount(_unescape_mount(parts[0]), _unescape_mount(parts[1]), parts[2]))
    return mounts


def mount_for(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding an absolute, resolved path: the longest matching mountpoint, last one wins."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mountpoint.rstrip("/") or "/"
        if path == mp or path.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/"):
                best = m
    return best


def is_network_fs(fstype: str) -> bool:
    fstype = fstype.lower()
    if fstype in LOCAL_FUSE:
        return False
    return fstype in NETWORK_FS or fstype.startswith(NETWORK_FS_PREFIXES)


def parse_listening_ports(text: str) -> set[int]:
    """Ports in LISTEN state (0A) from /proc/net/tcp and /proc/net/tcp6 text."""
    ports = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3] == "0A" and ":" in parts[1]:
            try:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
            except ValueError:
                continue
    return ports


def free_port_block(listening: set[int], n: int, after: int, stop: int = 65535) -> int | None:
    """The first port p > `after` with p .. p+n-1 all not listening (a base_port to suggest)."""
    p = after + 1
    while p + n - 1 <= stop:
        clash = [q for q in range(p, p + n) if q in listening]
        if not clash:
            return p
        p = clash[-1] + 1
    return None


def port_remedy(cfg: FleetConfig, busy: list[int], listening: set[int], n: int) -> str:
    """What to change when a server's port is held by a process that is not this fleet's server
    (another user's fleet on a shared machine, or another program)."""
    stop = f"or stop what listens there (`ss -ltnp 'sport = :{busy[0]}'` on the node)"
    if cfg.servers.ports is not None:
        return f"give servers.ports other ports (or FLEET_SERVERS__PORTS='[…]'), {stop}"
    base = free_port_block(listening, n, max(busy))
    free = (f" (ports {base}-{base + n - 1} are free now: base_port = {base}, or FLEET_SERVERS__BASE_PORT={base})"
            if base else "")
    return f"change servers.base_port{free}, {stop}"


def split_sections(text: str) -> dict[str, str]:
    """Split the gather script's output on '@@name' marker lines."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


# -- gathering -------------------------------------------------------------------------

# sh -c GATHER fleet-preflight DU_PATH [ROLE PATH]...
# One round trip: an SSH session to a node with a slow login shell costs seconds each.
# Paths arrive as positional arguments and are only ever used quoted ("$p"): a path with a
# space, a '*' or a leading '-' is one path, never split, globbed or read as an option.
UID_MARK = "@uid"   # in a path handed to _GATHER: the node's uid (`id -u`)
_GATHER = r"""
du_path=$1; shift
echo "@@nvidia-smi"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version --format=csv,noheader,nounits 2>&1
  echo "@@nvidia-smi-rc"; echo $?
else
  echo "@@nvidia-smi-rc"; echo 127
fi
echo "@@nproc"; nproc 2>/dev/null || getconf _NPROCESSORS_ONLN
echo "@@meminfo"; cat /proc/meminfo
echo "@@mounts"; cat /proc/mounts
echo "@@tcp"; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null
uid=$(id -u)
while [ "$#" -ge 2 ]; do
  role=$1; p=$2; shift 2
  case $p in *"/fleet-@uid/"*) p="${p%%/fleet-@uid/*}/fleet-$uid/${p#*/fleet-@uid/}" ;; esac
  d=$p; while [ ! -e "$d" ] && [ "$d" != "/" ] && [ "$d" != "." ]; do d=$(dirname -- "$d"); done
  echo "@@path $role"
  printf '%s\n' "$p"
  readlink -m -- "$p" 2>/dev/null || printf '%s\n' "$p"
  readlink -m -- "$d" 2>/dev/null || printf '%s\n' "$d"
  if [ -e "$p" ]; then echo exists; else echo missing; fi
  df -B1 --output=avail -- "$d" 2>/dev/null | tail -n 1
done
echo "@@du"
if [ -n "$du_path" ] && [ -e "$du_path" ]; then du -sbL -- "$du_path" 2>/dev/null | cut -f1; fi
echo "@@python"; command -v python3 || true
echo "@@uv"; command -v uv || ls "$HOME/.local/bin/uv" 2>/dev/null || true
echo "@@end"
"""


def servers_on_node(cfg: FleetConfig, gpu_count: int, node_cfg: NodeConfig | None = None) -> int:
    """How many servers a node runs: the node's count, the configured count, else one per GPU group, else 1."""
    if node_cfg is not None and node_cfg.servers is not None:
        return node_cfg.servers
    if cfg.servers.count is not None:
        return cfg.servers.count
    if gpu_count:
        return max(1, gpu_count // cfg.servers.tensor_parallel)
    return 1


def needs_gpus(cfg: FleetConfig) -> bool:
    if cfg.engine.kind in ("sglang", "vllm"):
        return True
    return cfg.engine.kind == "transformers" and (cfg.engine.device or "").startswith("cuda")


def gather(node: Node, cfg: FleetConfig, node_cfg: NodeConfig) -> NodeReport:
    """Inspect one node. Never raises for an unreachable node: the report says so."""
    t0 = time.monotonic()
    report = NodeReport(node=node_cfg.name, host=node.host, reachable=False)
    roles = {"workdir": node_cfg.workdir, "ramdisk": node_cfg.ramdisk}
    if not cfg.venv.use_existing or cfg.venv.path:
        roles["venv"] = cfg.venv.path
    if cfg.model.source:
        roles["model_source"] = cfg.model.source
        if cfg.model.stage:
            from fleet.staging import fleet_root
            # this fleet's copies (the script names each by its source's state); `@uid` is the node's uid
            roles["staging_target"] = fleet_root(node_cfg.ramdisk, cfg.name, UID_MARK)
    argv = ["sh", "-c", _GATHER, "fleet-preflight", cfg.model.source or "",
            *[item for role, path in roles.items() for item in (role, path)]]
    try:
        res = node.run(argv, timeout=120)
    except (HostKeyError, AuthFailed):
        # Not "unreachable": a changed host key or a refused key fails the same way on every
        # retry, and a retry against a changed key is one more handshake with a possible
        # impostor. The caller must stop here, not wrap it in a transient error.
        raise
    except FleetError as exc:
        report.error = exc.one_line()
        report.seconds = time.monotonic() - t0
        return report
    report.reachable = True
    sec = split_sections(res.stdout)
    rc = sec.get("nvidia-smi-rc", "127").strip()
    if rc == "0":
        report.gpus = parse_nvidia_smi(sec.get("nvidia-smi", ""))
        report.nvidia_smi = "ok"
    elif rc == "127":
        report.nvidia_smi = "absent"
    else:
        report.nvidia_smi = "error: " + (sec.get("nvidia-smi", "").strip().splitlines() or ["?"])[-1]
    nproc = sec.get("nproc", "").strip()
    report.cpu_count = int(nproc) if nproc.isdigit() else None
    report.mem_total_bytes, report.mem_available_bytes = parse_meminfo(sec.get("meminfo", ""))
    mounts = parse_mounts(sec.get("mounts", ""))
    listening = parse_listening_ports(sec.get("tcp", ""))
    report.listening = listening
    du = sec.get("du", "").strip()
    for name, body in sec.items():
        if not name.startswith("path "):
            continue
        lines = body.splitlines() + [""] * 5
        role = name[5:]
        resolved, ancestor, exists, avail = lines[1].strip(), lines[2].strip(), lines[3] == "exists", lines[4].strip()
        m = mount_for(resolved if exists else ancestor, mounts)
        report.paths.append(PathInfo(
            role=role, path=lines[0], resolved=resolved, exists=exists,
            fstype=m.fstype if m else "unknown", mountpoint=m.mountpoint if m else "?",
            network=bool(m and m.network), avail_bytes=int(avail) if avail.isdigit() else None,
            size_bytes=int(du) if role == "model_source" and du.isdigit() else None,
        ))
    report.python = sec.get("python", "").strip() or None
    report.uv = sec.get("uv", "").strip() or None
    report.command_s = _command_s(node)
    gpu_ids = [g.index for g in report.gpus if node_cfg.gpus is None or g.index in node_cfg.gpus]
    n = servers_on_node(cfg, len(gpu_ids), node_cfg)
    for i in range(n):
        try:
            port = cfg.servers.port_for(i, node_cfg)
        except FleetError:
            continue
        report.ports[port] = port not in listening
    report.checks = evaluate(report, cfg, node_cfg)
    report.seconds = time.monotonic() - t0
    return report


SLOW_COMMAND_S = 0.25   # a no-op command slower than this on the node: warn (fleet sends hundreds)


def _command_s(node: Node, tries: int = 3) -> float | None:
    """The quickest of `tries` no-op commands on the node, in seconds (None if one failed)."""
    times = []
    for _ in range(tries):
        t0 = time.monotonic()
        try:
            node.run(["true"], timeout=30)
        except FleetError:
            return None
        times.append(time.monotonic() - t0)
    return round(min(times), 3)


def evaluate(report: NodeReport, cfg: FleetConfig, node_cfg: NodeConfig) -> list[Check]:
    """The checks, hard (stop this node) and soft (warn), from a gathered report."""
    checks: list[Check] = []
    if report.command_s is not None:
        checks.append(Check(
            "command-latency", report.command_s <= SLOW_COMMAND_S, False,
            f"a no-op command takes {report.command_s * 1000:.0f} ms on the node",
            "fleet runs hundreds of commands on a node (about 40 for a bring-up, one every few seconds while a "
            "job runs); besides the network, each pays the login shell's start, and bash reads ~/.bashrc for "
            "every SSH command: make it return at once when not interactive (`case $- in *i*) ;; *) return;; "
            "esac` at its top, above conda, pyenv or module setup)"))
    gpu_ids = [g.index for g in report.gpus if node_cfg.gpus is None or g.index in node_cfg.gpus]
    if node_cfg.gpus is not None:
        missing = sorted(set(node_cfg.gpus) - {g.index for g in report.gpus})
        if missing:
            checks.append(Check("gpus", False, True, f"configured GPUs {missing} not found by nvidia-smi",
                                "fix nodes.gpus to the indices nvidia-smi lists"))
    n = servers_on_node(cfg, len(gpu_ids), node_cfg)
    if needs_gpus(cfg):
        need = n * cfg.servers.tensor_parallel
        checks.append(Check(
            "gpus", len(gpu_ids) >= need, True,
            f"{len(gpu_ids)} GPU(s) for {n} server(s) × tp {cfg.servers.tensor_parallel} = {need} needed"
            + ("" if report.nvidia_smi == "ok" else f" (nvidia-smi {report.nvidia_smi})"),
            "use a node with more GPUs, or lower servers.count / servers.tensor_parallel",
        ))
    else:
        checks.append(Check("gpus", True, False, f"{len(gpu_ids)} GPU(s); engine {cfg.engine.kind} needs none"))

    venv = report.path("venv")
    if venv is not None and not cfg.venv.use_existing:
        checks.append(Check(
            "venv-local-fs", not venv.network, True,
            f"venv {venv.path} is on {venv.fstype} ({venv.mountpoint})",
            "put venv.path on a local disk (e.g. /opt/fleet/venv or /root/venvs): "
            "imports from a network filesystem hang for minutes",
        ))
    elif venv is not None and venv.network:
        checks.append(Check("venv-local-fs", False, False, f"existing venv {venv.path} is on {venv.fstype}",
                            "recreate it on a local disk; imports will be slow"))

    src = report.path("model_source")
    if cfg.model.source:
        ok = src is not None and src.exists
        checks.append(Check("model-source", ok, True,
                            f"{cfg.model.source} " + ("found" if ok else "does not exist on the node")
                            + (f", {src.size_bytes / 1e9:.2f} GB" if src and src.size_bytes else "")
                            + (f", on {src.fstype}" if src else ""),
                            "fix model.source to the model directory's path on the node"))
        if src is not None and src.network and not cfg.model.stage:
            checks.append(Check("model-source-fs", False, False,
                                f"model is read from {src.fstype} at every server start",
                                "set model.stage = true to copy it once to the RAM disk"))

    ram = report.path("ramdisk")
    if cfg.model.stage and cfg.model.source:
        target = report.path("staging_target")
        need = (src.size_bytes or 0) if src else 0
        already = 0
        if target is not None and target.exists:
            already = need  # this fleet has a copy (of this source, most often): staging's own check is exact
        margin = int(cfg.model.stage_margin_gb * 1e9)
        avail = ram.avail_bytes if ram else None
        room = avail is not None and avail + already >= need + margin
        checks.append(Check(
            "ramdisk-room", room, True,
            f"{node_cfg.ramdisk}: {_gb(avail)} free, model {_gb(need)} + margin {_gb(margin)}",
            f"free space in {node_cfg.ramdisk}, lower model.stage_margin_gb, or set model.stage = false",
        ))
        if ram is not None and ram.fstype not in ("tmpfs", "ramfs"):
            checks.append(Check("ramdisk-type", False, False,
                                f"{node_cfg.ramdisk} is {ram.fstype}, not tmpfs",
                                "set nodes.ramdisk to a tmpfs mount such as /dev/shm"))

    busy = [p for p, free in report.ports.items() if not free]
    checks.append(Check(
        "ports", not busy, False,
        f"ports {sorted(report.ports)} " + ("free" if not busy else f"— in use: {busy}"),
        "a server this fleet recorded there is adopted at launch; otherwise "
        + (port_remedy(cfg, busy, report.listening | set(busy), len(report.ports)) if busy else "nothing to do"),
    ))
    if not report.python:
        checks.append(Check("python3", False, True, "no python3 on the node's PATH",
                            "install python3 (it runs fleet's staging and the venv bootstrap)"))
    return checks


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB"


# -- rendering -------------------------------------------------------------------------

def render(reports: list[NodeReport]) -> str:
    """The report as text: a head line per node, its GPU and path tables (rich), then its checks."""
    from fleet.tables import table

    out = []
    for r in reports:
        head = f"node {r.node} ({r.host})"
        if not r.reachable:
            out.append(f"{head}: UNREACHABLE — {r.error}")
            continue
        out.append(f"{head}: {'OK' if r.ok else 'FAILED'} in {r.seconds:.1f} s")
        out.append(f"  cpus {r.cpu_count}, RAM {_gb(r.mem_total_bytes)} ({_gb(r.mem_available_bytes)} available), "
                   f"python3 {r.python or '—'}, uv {r.uv or '—'}")
        if r.gpus:
            out.append(table(["gpu", "name", "total MiB", "used MiB", "free MiB", "driver"],
                             [[str(g.index), g.name, str(g.memory_total_mib), str(g.memory_used_mib),
                               str(g.memory_free_mib), g.driver_version] for g in r.gpus],
                             indent=2, right=("gpu", "total MiB", "used MiB", "free MiB"), max_cell=None))
        else:
            out.append(f"  no GPUs (nvidia-smi {r.nvidia_smi})")
        out.append(table(["path", "fs", "network", "free", "location"],
                         [[p.role, p.fstype, "YES" if p.network else "no", _gb(p.avail_bytes),
                           p.path + ("" if p.exists else " (not yet created)")] for p in r.paths],
                         indent=2, right=("free",), max_cell=None))
        for c in r.checks:
            mark = "ok  " if c.ok else ("FAIL" if c.hard else "warn")
            line = f"  [{mark}] {c.name}: {c.detail}"
            if not c.ok and c.remedy:
                line += f" — {c.remedy}"
            out.append(line)
    return "\n".join(out)
