"""RAM-disk staging: the stage script on the node and `stage_model` driving it through the Node seam.

`node` (tests/conftest.py) runs each test over the local and the SSH transport; the SSH
node is this machine through a throwaway sshd, so tmp_path is the same place for both and
plays the RAM disk. Where this sandbox lets us mount a small tmpfs, the "too small" and
"full" cases use a real one.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fleet.errors import CommandFailed, PreflightFailed
from fleet.node.local import LocalNode
from fleet.staging import (MANIFEST_NAME, STAGE_SCRIPT, fleet_root, is_staged, parse_df_avail, parse_report,
                           read_manifest, stage_argv, stage_model)

# The node runs the script with a bare system python, not our venv.
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
BIG = 50 * 10**6


def make_model(root: Path) -> Path:
    """A model-shaped tree: nested dirs, a 50 MB shard, a symlinked file and a symlinked dir."""
    rnd = random.Random(7)
    (root / "weights").mkdir(parents=True)
    (root / "tokenizer" / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3"}\n')
    (root / "weights" / "model-00001-of-00002.safetensors").write_bytes(rnd.randbytes(BIG))
    (root / "weights" / "model-00002-of-00002.safetensors").write_bytes(rnd.randbytes(3 * 2**20 + 17))
    (root / "tokenizer" / "sub" / "vocab.txt").write_text("a\nb\nc\n")
    (root / "zero.bin").write_bytes(b"")
    os.symlink("config.json", root / "linked.json")  # HF cache style: files are links into blobs/
    os.symlink("tokenizer", root / "tok-alias")
    return root


def tree(root: Path) -> dict[str, str]:
    """rel path -> sha256 of every file (symlinks followed), fleet's own files left out."""
    out = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=True):
        for name in files:
            if name.startswith(".fleet-stage"):
                continue
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def model_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("template") / "Qwen3-Tiny")


@pytest.fixture
def model(model_template: Path, tmp_path: Path) -> Path:
    """A fresh copy per test (tests change it): links stay links, mtimes are kept."""
    return Path(shutil.copytree(model_template, tmp_path / "nfs" / "Qwen3-Tiny", symlinks=True))


@pytest.fixture
def ramdisk(tmp_path: Path) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    return d


def stage(node, model: Path, ramdisk: Path, tmp_path: Path, **kw):
    kw.setdefault("margin_bytes", 0)
    kw.setdefault("fleet", "t")
    return stage_model(node, source=str(model), ramdisk=str(ramdisk), workdir=str(tmp_path / "work"),
                       python=PY, streams=4, **kw)


def copies(ramdisk: Path, fleet: str = "t") -> list[Path]:
    """The copies staged for `fleet` by this user."""
    root = Path(fleet_root(str(ramdisk), fleet, os.getuid()))
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def the_copy(ramdisk: Path, fleet: str = "t") -> Path:
    found = copies(ramdisk, fleet)
    assert len(found) == 1, found
    return found[0]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(STAGE_SCRIPT), *args], capture_output=True, text=True, timeout=60)


# -- pure helpers ------------------------------------------------------------------------

def test_fleet_root_and_a_source_without_a_name(tmp_path: Path) -> None:
    assert fleet_root("/dev/shm/", "b200", 1001) == "/dev/shm/fleet-1001/b200"
    with pytest.raises(Exception, match="no directory name"):
        stage_model(LocalNode(), source="/", ramdisk="/dev/shm", fleet="t", workdir=str(tmp_path / "w"))


def test_stage_argv_and_parsers() -> None:
    assert stage_argv("python3", "/w/bin/fleet_stage.py", source="/m", ramdisk="/dev/shm", fleet="b200", streams=3,
                      verify=True, plan_only=True) == [
        "python3", "/w/bin/fleet_stage.py", "--src", "/m", "--ramdisk", "/dev/shm", "--fleet", "b200",
        "--streams", "3", "--verify", "--plan-only"]
    assert parse_df_avail("    Avail\n20971520\n") == 20971520
    assert parse_report('fleet-stage: copied 1 MiB\n{"files": 2}\nfleet-stage: done') == {"files": 2}
    assert parse_report("no json here") is None


def test_stage_script_runs_on_a_bare_python38() -> None:
    """Protects the contract that the node needs nothing but python3 >= 3.8 (no third-party imports)."""
    source = STAGE_SCRIPT.read_text()
    tree_ = ast.parse(source, feature_version=(3, 8))
    imported = set()
    for node_ in ast.walk(tree_):
        if isinstance(node_, ast.Import):
            imported |= {a.name.split(".")[0] for a in node_.names}
        elif isinstance(node_, ast.ImportFrom) and node_.level == 0:
            imported.add(node_.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported - set(sys.stdlib_module_names)


# -- staging ---------------------------------------------------------------------------

def test_stages_tree_with_complete_manifest(node, model, ramdisk, tmp_path) -> None:
    res = stage(node, model, ramdisk, tmp_path)
    dst = the_copy(ramdisk)
    assert res.dst == str(dst) and dst.name.startswith("Qwen3-Tiny-")
    assert tree(dst) == tree(model)
    assert (dst / "empty").is_dir()
    assert (dst / "tok-alias" / "sub" / "vocab.txt").is_file()
    assert not (dst / "linked.json").is_symlink()  # links are resolved to real files in the copy
    assert res.files == 7 and res.copied_files == 7 and res.skipped_files == 0 and not res.adopted
    assert res.bytes_total == res.bytes_copied == sum(p.stat().st_size for p in dst.rglob("*")
                                                      if p.is_file() and not p.name.startswith(".fleet"))
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    assert manifest["complete"] is True
    entries = {e["path"]: e for e in manifest["files"]}
    assert set(entries) == set(tree(model))
    big = model / "weights" / "model-00001-of-00002.safetensors"
    assert entries["weights/model-00001-of-00002.safetensors"]["size"] == BIG
    assert entries["weights/model-00001-of-00002.safetensors"]["mtime_ns"] == big.stat().st_mtime_ns
    assert "sha256" not in entries["config.json"]
    assert is_staged(node, str(dst))
    assert not list(dst.rglob("*.fleet-part"))
    assert (tmp_path / "work" / "bin" / "fleet_stage.py").read_bytes() == STAGE_SCRIPT.read_bytes()


def test_second_run_adopts_without_copying(node, model, ramdisk, tmp_path) -> None:
    stage(node, model, ramdisk, tmp_path)
    manifest = the_copy(ramdisk) / MANIFEST_NAME
    before = manifest.stat()
    t0 = time.monotonic()
    res = stage(node, model, ramdisk, tmp_path)
    assert res.adopted and res.copied_files == 0 and res.bytes_copied == 0 and res.skipped_files == 7
    assert time.monotonic() - t0 < 60   # the counts above prove no copy; this only catches a hang
    # never rewritten, so never even briefly "incomplete" under servers that read the copy
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert tree(the_copy(ramdisk)) == tree(model)


def test_script_uploaded_only_when_changed(model, ramdisk, tmp_path) -> None:
    puts = []

    class Counting(LocalNode):
        def put(self, local, remote):
            puts.append(remote)
            super().put(local, remote)

    node = Counting()
    stage(node, model, ramdisk, tmp_path)
    stage(node, model, ramdisk, tmp_path)
    assert len(puts) == 1
    (tmp_path / "work" / "bin" / "fleet_stage.py").write_text("# an old version\n")
    stage(node, model, ramdisk, tmp_path)
    assert len(puts) == 2


def test_a_changed_source_is_a_new_copy_and_the_old_one_is_never_written(node, model, ramdisk, tmp_path) -> None:
    """Fault: a changed source was re-copied in place, under the servers still serving the old files.
    Now it is a new copy (its own key) beside the old one, which stays byte for byte as it was (servers
    move when the bring-up replaces them); only the changed files are copied, the rest are hard links
    of the old copy's files (one inode: no RAM twice, and neither copy is ever written in place)."""
    old = Path(stage(node, model, ramdisk, tmp_path).dst)
    before = tree(old)
    big_ino = (old / "weights" / "model-00001-of-00002.safetensors").stat().st_ino
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # mtime only
    (model / "tokenizer" / "sub" / "vocab.txt").write_text("a\nb\nc\nd\n")  # size
    # the room check counts the files to be linked as staged: a second copy needs room for the changes only
    plan = json.loads(run_script("--src", str(model), "--ramdisk", str(ramdisk), "--fleet", "t", "--plan-only").stdout)
    assert plan["bytes_total"] - plan["already_staged_bytes"] == 2 * (model / "config.json").stat().st_size + 2 * 8
    res = stage(node, model, ramdisk, tmp_path)
    new = Path(res.dst)
    assert new != old and new.parent == old.parent and copies(ramdisk) == sorted([old, new])
    assert tree(old) == before and is_staged(node, str(old))
    assert tree(new) == tree(model) and is_staged(node, str(new))
    # each change reaches two staged files: through the symlinked file and the symlinked dir
    assert res.copied_files == 4 and res.skipped_files == 3
    assert res.bytes_copied == 2 * (model / "config.json").stat().st_size + 2 * 8
    assert (new / "weights" / "model-00001-of-00002.safetensors").stat().st_ino == big_ino
    assert (old / "weights" / "model-00001-of-00002.safetensors").stat().st_ino == big_ino


def test_verify_catches_a_corrupt_copy_with_same_size_and_mtime(node, model, ramdisk, tmp_path) -> None:
    """Size+mtime cannot see bit rot or a stray write that restored the mtime; --verify must."""
    dst = Path(stage(node, model, ramdisk, tmp_path).dst)
    victim = dst / "weights" / "model-00002-of-00002.safetensors"
    st = victim.stat()
    with open(victim, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"garbage!" * 64)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))

    assert stage(node, model, ramdisk, tmp_path).adopted  # the cheap check is fooled, by design
    res = stage(node, model, ramdisk, tmp_path, verify=True)
    assert res.verified and res.copied_files == 1 and res.bytes_copied == victim.stat().st_size
    assert tree(dst) == tree(model)
    manifest = read_manifest(node, str(dst))
    assert manifest["verified"] is True
    assert all(len(e["sha256"]) == 64 for e in manifest["files"])
    # the recorded hashes spare a slow source the next time
    again = stage(node, model, ramdisk, tmp_path, verify=True)
    assert again.adopted and again.verified


def test_interrupted_copy_is_finished_never_served(node, model, ramdisk, tmp_path) -> None:
    """A half-done copy (marker incomplete, a part file, a truncated file, stale junk) is redone."""
    dst = Path(stage(node, model, ramdisk, tmp_path).dst)
    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    manifest["complete"] = False
    (dst / MANIFEST_NAME).write_text(json.dumps(manifest))
    with open(dst / "weights" / "model-00001-of-00002.safetensors", "r+b") as fh:
        fh.truncate(BIG // 3)
    (dst / "weights" / "model-00002-of-00002.safetensors").rename(
        dst / "weights" / "model-00002-of-00002.safetensors.fleet-part")
    (dst / "stale.bin").write_bytes(b"old")
    (dst / "old-dir").mkdir()
    (dst / "old-dir" / "x").write_text("x")
    assert not is_staged(node, str(dst))

    res = stage(node, model, ramdisk, tmp_path)
    assert res.copied_files == 2 and res.removed_files == 3
    assert tree(dst) == tree(model)
    assert not (dst / "old-dir").exists() and not list(dst.rglob("*.fleet-part"))
    assert is_staged(node, str(dst))


def test_killed_copy_is_resumed(node, model, ramdisk, tmp_path) -> None:
    """Kill -9 the stage script mid-file: the copy must read as incomplete, then be finished."""
    # 5 MB/s: the 50 MB file takes 10 s, so the kill lands mid-file even when the poll runs late
    proc = subprocess.Popen([PY, str(STAGE_SCRIPT), "--src", str(model), "--ramdisk", str(ramdisk), "--fleet", "t",
                             "--streams", "1", "--max-mb-s", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (found := list(ramdisk.rglob("model-00001-of-00002.safetensors.fleet-part"))):
        assert proc.poll() is None and time.monotonic() < deadline, "stage script never started the big file"
        time.sleep(0.02)
    part = found[0]
    dst = part.parent.parent
    # mid-file: some bytes written (polled, not slept for)
    while part.exists() and part.stat().st_size == 0:
        assert proc.poll() is None and time.monotonic() < deadline + 30, "no byte of the big file copied"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert part.exists()
    assert not (dst / "weights" / "model-00001-of-00002.safetensors").exists()
    assert not is_staged(node, str(dst))

    res = stage(node, model, ramdisk, tmp_path)
    assert res.copied_files >= 1 and not res.adopted
    assert tree(dst) == tree(model)
    assert is_staged(node, str(dst)) and not part.exists()


def test_concurrent_stagers_take_turns(node, model, ramdisk, tmp_path) -> None:
    """A second stager (a retry racing a slow first try) waits for the first, then adopts its copy."""
    first = subprocess.Popen([PY, str(STAGE_SCRIPT), "--src", str(model), "--ramdisk", str(ramdisk), "--fleet", "t",
                              "--streams", "2", "--max-mb-s", "40"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    deadline = time.monotonic() + 10
    while not list(ramdisk.rglob("*.fleet-part")):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    res = stage(node, model, ramdisk, tmp_path)
    dst = the_copy(ramdisk)
    out, _ = first.communicate(timeout=30)
    assert first.returncode == 0 and json.loads(out)["copied_files"] == 7
    assert res.adopted and tree(dst) == tree(model) and is_staged(node, str(dst))


# -- too small, missing, wrong -------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """Mount a small tmpfs (root in this sandbox); None where mounting is not allowed."""
    mounted = []

    def mount(size: str, nr_inodes: int | None = None) -> Path | None:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
        if shutil.which("mount") is None:
            return None
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            return None
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_ramdisk_too_small_fails_before_copying(node, model, tmp_path, small_tmpfs) -> None:
    shm = small_tmpfs("20m")
    margin = 0
    if shm is None:  # no mount here: an enormous margin trips the same check
        shm = tmp_path / "shm"
        shm.mkdir()
        margin = 2**60
    with pytest.raises(PreflightFailed) as info:
        stage(node, model, shm, tmp_path, margin_bytes=margin)
    msg = str(info.value)
    assert "too small" in msg and f"node {node.name}" in msg and "GiB" in msg and "model.stage=false" in msg
    assert not list(shm.rglob("Qwen3-Tiny*"))  # not one byte copied, not even the directory


def test_full_ramdisk_mid_copy_exits_3_and_stays_incomplete(model, tmp_path, small_tmpfs) -> None:
    """Room by bytes but not by inodes: ENOSPC hits mid-copy; the copy must stay marked incomplete."""
    shm = small_tmpfs("200m", nr_inodes=8)
    if shm is None:
        pytest.skip("cannot mount a tmpfs here")
    src = tmp_path / "many"
    src.mkdir()
    for i in range(20):
        (src / f"f{i:02d}").write_text(str(i))
    r = run_script("--src", str(src), "--dst", str(shm / "many"), "--streams", "2")
    assert r.returncode == 3, r.stderr
    assert "no space left" in r.stderr and "free" in r.stderr
    assert json.loads((shm / "many" / MANIFEST_NAME).read_text())["complete"] is False
    assert not list((shm / "many").glob("*.fleet-part"))


def test_missing_source_is_a_clear_error(node, ramdisk, tmp_path) -> None:
    with pytest.raises(CommandFailed) as info:
        stage(node, tmp_path / "nope" / "Model", ramdisk, tmp_path)
    assert info.value.exit_code == 2
    assert "does not exist" in str(info.value) and "model.source" in info.value.remedy
    assert not list(ramdisk.iterdir())


def test_source_already_in_ramdisk_is_refused(node, model, tmp_path) -> None:
    with pytest.raises(CommandFailed) as info:
        stage(node, model, model.parent, tmp_path)
    assert "already in the RAM disk" in str(info.value) and "model.stage=false" in info.value.remedy
    assert tree(model)  # untouched


def test_plan_only_reports_sizes_and_copies_nothing(model, ramdisk) -> None:
    dst = ramdisk / "Qwen3-Tiny"
    r = run_script("--src", str(model), "--dst", str(dst), "--streams", "2", "--plan-only")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["files"] == 7 and plan["already_staged_bytes"] == 0 and plan["bytes_total"] > BIG
    assert not dst.exists()


# -- whose copy ------------------------------------------------------------------------

OTHER_UID = 54321   # a throwaway uid with no account: the stage script needs none


@pytest.fixture
def shared_shm(tmp_path: Path):
    """A world-writable, sticky RAM disk (as /dev/shm is) and a source another uid can read; root only."""
    if os.getuid() != 0:
        pytest.skip("running a process as a second uid needs root")
    base = Path(tempfile.mkdtemp(prefix="fleet-uids-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        base.chmod(0o755)
        shm = base / "shm"
        shm.mkdir()
        shm.chmod(0o1777)
        script = base / "fleet_stage.py"
        shutil.copy(STAGE_SCRIPT, script)
        script.chmod(0o644)
        yield base, shm, script
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, user=uid, group=uid,
                          extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/")


def test_two_uids_stage_one_model_name_into_their_own_copies(shared_shm) -> None:
    """Fault: another user's demo re-copied its `sim-model` over the copy this user's servers were serving
    (one <ramdisk>/<name> for everyone). Now each uid stages under RAMDISK/fleet-<uid> (mode 0700): two
    uids with the same model name and fleet name get two copies, neither writes the other's; a directory
    planted under this user's name by another uid is refused, never written into."""
    base, shm, script = shared_shm
    models = {}
    for who, fill in (("root", b"R"), ("other", b"O")):
        src = base / who / "sim-model"
        src.mkdir(parents=True)
        (src / "weights.bin").write_bytes(fill * 4096)
        for p in (base / who, src, src / "weights.bin"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        models[who] = src
    mine = subprocess.run([PY, str(script), "--src", str(models["root"]), "--ramdisk", str(shm), "--fleet", "demo"],
                          capture_output=True, text=True, timeout=120)
    assert mine.returncode == 0, mine.stderr
    theirs = as_uid(OTHER_UID, PY, str(script), "--src", str(models["other"]), "--ramdisk", str(shm),
                    "--fleet", "demo")
    assert theirs.returncode == 0, theirs.stderr
    dst_mine, dst_theirs = Path(json.loads(mine.stdout)["dst"]), Path(json.loads(theirs.stdout)["dst"])
    assert dst_mine.parent == shm / "fleet-0" / "demo" and dst_theirs.parent == shm / f"fleet-{OTHER_UID}" / "demo"
    assert (dst_mine / "weights.bin").read_bytes() == b"R" * 4096
    assert (dst_theirs / "weights.bin").read_bytes() == b"O" * 4096
    assert (shm / f"fleet-{OTHER_UID}").stat().st_uid == OTHER_UID
    assert (shm / f"fleet-{OTHER_UID}").stat().st_mode & 0o777 == 0o700
    # the other uid cannot even look into this user's copies
    assert as_uid(OTHER_UID, "ls", str(shm / "fleet-0")).returncode != 0

    # a directory planted under another uid's name is never written into
    victim = OTHER_UID + 1
    (shm / f"fleet-{victim}").mkdir(mode=0o777)    # planted by root, for uid `victim`
    planted = as_uid(victim, PY, str(script), "--src", str(models["other"]), "--ramdisk", str(shm), "--fleet", "demo")
    assert planted.returncode == 2 and "is not a directory of this user" in planted.stderr, planted.stderr
    assert list((shm / f"fleet-{victim}").iterdir()) == []
    from fleet.staging import _failed

    err = _failed(LocalNode(), 2, argv=[], stderr=planted.stderr, source="/m", dst="/d", ramdisk=str(shm))
    assert "nodes.ramdisk" in err.remedy and "model.source" not in err.remedy
