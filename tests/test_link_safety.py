"""Case F15: with RUN_AS, no file operation of the (root) sidecar in a directory a tool can
write follows a link.

Kind: the sidecar, as root, creates, reads, chowns or removes a file by a path inside a
directory that the tool's user can write: the attempt's work directory (owned by the
RUN_AS user, shared by every sibling attempt of that user at --concurrency above 1) or a
shared work root (/tmp, an emptyDir). Any name on that path may be a symlink the tool
planted, so root writes, chowns, reads or removes a file the tool chose. The fix: each
such operation names one component relative to a directory descriptor, with
O_NOFOLLOW, O_CREAT|O_EXCL for new files, fchown/fchmod on descriptors
(sidecar/worker/safefs.py), and the sidecar writes its own files into a work directory before
it hands the directory to the tool's user.

Every place audited (what it does now):

- checkpoint (sidecar/worker/supervisor.py -> Sandbox ``files``/``write_file``): written in
  ``Sandbox.open`` while the directory is still root's 0700, O_EXCL|O_NOFOLLOW through
  the directory's descriptor, fchown on the file's descriptor; ``write_file`` after the
  hand-over raises.
- work-directory setup (``Sandbox._make_dir``/``_hand_over``): mkdir at the work root's
  descriptor, opened O_NOFOLLOW and checked to be ours; HOME (``h``) and the runtime
  directory (``r``) made by mkdirat, chowned by fchown through O_NOFOLLOW descriptors,
  the work directory itself last. The XDG homes are only variables (the tool makes them).
- the result file (``Sandbox.has_result``/``read_result`` -> ``read_result_file`` with
  ``dir_fd``): fstatat and openat of one name through the work directory's descriptor,
  O_NOFOLLOW, regular file of the tool's uid with one link; the path the tool got is
  never opened by the sidecar.
- reuse of kept work directories (``open_kept``/``close_kept``/``_pristine``): only
  without RUN_AS; the kept directory and its HOME and runtime directory are checked
  through descriptors (fstat, flistxattr, listdir of a descriptor).
- removal after an attempt (``Sandbox.close``/``_remove_untouched``): rmdirat through
  the held descriptor; the work directory's name goes only while it still is that
  directory (a link in its place is unlinked, a swapped-in directory is left); the rest
  by ``safefs.clear_dir``: no shutil.rmtree, no path walked, fchmod only through a
  descriptor, never into another filesystem, at most MAX_HELD_DIRS descriptors held.
- kept directories found touched or discarded at shutdown (``SparePool.take``,
  ``SparePool.close``): removed through the descriptor that locks them.
- abandoned work directories (sidecar/worker/leftovers.py ``remove_if_abandoned``, used by the
  start-up sweep and the guardian): locked and removed through the descriptor, only if
  the name still is the directory that was locked.
- owner lock files in the work root (``OwnerLock.acquire``, ``sweep_dead_owners``):
  O_NOFOLLOW|O_NONBLOCK; a link, FIFO or foreign file under the lock's name is removed,
  never opened; the sweep unlinks only the file it locked.
- the work-root probe (``check_work_dir``): mkdtemp + rmdir, neither follows a last
  component; the work root path itself is the operator's.
- the attempt's guard socket (``Sandbox._listen_guard`` -> ``safefs.listen_unix``, issue
  41): bound through ``/proc/self/fd/<work dir's descriptor>/guard.sock`` in ``open``
  before the hand-over (bind never follows a link in its last component nor reuses a
  name), chowned by fchownat without following a link; its name is unlinked through the
  descriptor by ``close``/``close_kept``. Job cgroups live on cgroupfs, which the RUN_AS
  user cannot write (tests/test_isolation_breakers.py).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from kit import TOOLS, base_env, cli, enqueue, job_row, short_root
from sidecar.protocol.results import BadResult
from sidecar.runtime.config import load_settings
from sidecar.worker import safefs
from sidecar.worker.cgroups import CgroupHost
from sidecar.worker.isolation import RESULT_FILE_NAME, Sandbox
from sidecar.worker.leftovers import OwnerLock, owner_key, remove_if_abandoned, remove_tree

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="RUN_AS needs a root sidecar")
TOOL_UID = 4242
SECRET = "root only\n"


@pytest.fixture
def secret(tmp_path) -> Path:
    """A root-only 0600 file (under pytest's 0700 directory)."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    return path


def _assert_untouched(path: Path) -> None:
    info = os.lstat(path)
    assert path.read_text() == SECRET, "the root-only file was written through a link"
    assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid()), \
        f"the root-only file now belongs to {info.st_uid}:{info.st_gid}"
    assert stat.S_IMODE(info.st_mode) == 0o600


def _as_tool(code: str, *args: str) -> None:
    """Run ``code`` as the tool's user (uid and gid 4242, no supplementary groups)."""
    done = subprocess.run(["/usr/bin/python3", "-c", code, *args], user=TOOL_UID,
                          group=TOOL_UID, extra_groups=[], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode()


def _sandbox(root: Path, run_as: str = f"{TOOL_UID}:{TOOL_UID}", **fields) -> Sandbox:
    settings = load_settings({"SIDECAR_WORK_DIR": str(root),
                              "SIDECAR_PROFILE_T_RUN_AS": run_as})
    profile = settings.profile("t")
    return Sandbox(settings, profile, CgroupHost(), "t-1", "abcdefabcdef.j", **fields)


# --- unit: the descriptor-based helpers -----------------------------------------------------

@pytest.mark.unit
def test_create_file_never_opens_an_existing_name(tmp_path, secret):
    """O_CREAT|O_EXCL|O_NOFOLLOW: a link to a root file, a FIFO (which would block an
    open for writing) or a file already there is refused, and the target is untouched."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "link").symlink_to(secret)
    os.mkfifo(d / "fifo")
    (d / "file").write_text("old")
    fd = safefs.open_dir(str(d))
    try:
        for name in ("link", "fifo", "file"):
            with pytest.raises(FileExistsError):
                safefs.create_file(fd, name, b"new")
        safefs.create_file(fd, "new", b"x" * 70000)
        with pytest.raises(ValueError):
            safefs.create_file(fd, "../escape", b"x")
    finally:
        os.close(fd)
    _assert_untouched(secret)
    assert (d / "file").read_text() == "old"
    assert (d / "new").read_bytes() == b"x" * 70000
    assert stat.S_IMODE((d / "new").stat().st_mode) == 0o600


@pytest.mark.unit
def test_listen_unix_never_binds_through_a_planted_name(tmp_path, secret):
    """The guard socket (issue 41) is bound through the directory's descriptor: a link, a
    file or a socket already under its name is refused (EADDRINUSE) and left as it was,
    its target untouched; a new one is 0600."""
    d = tmp_path / "d"
    d.mkdir()
    fd = safefs.open_dir(str(d))
    try:
        (d / "link").symlink_to(secret)
        (d / "file").write_text("old")
        for name in ("link", "file"):
            with pytest.raises(OSError):
                safefs.listen_unix(fd, name)
        sock = safefs.listen_unix(fd, "guard.sock")
        try:
            info = os.lstat(d / "guard.sock")
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
            with pytest.raises(OSError):
                safefs.listen_unix(fd, "guard.sock")
        finally:
            sock.close()
        with pytest.raises(ValueError):
            safefs.listen_unix(fd, "../escape")
    finally:
        os.close(fd)
    _assert_untouched(secret)
    assert (d / "file").read_text() == "old" and (d / "link").is_symlink()


@pytest.mark.unit
def test_open_subdir_and_make_private_dir_never_follow_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    fd = safefs.open_dir(str(tmp_path))
    try:
        with pytest.raises(OSError) as caught:
            safefs.open_subdir(fd, "link")
        assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
        name, sub = safefs.make_private_dir(fd, "p.j")
        os.close(sub)
    finally:
        os.close(fd)
    made = os.lstat(tmp_path / name)
    assert name.startswith("p.j") and len(name) == 11
    assert stat.S_ISDIR(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o700


@pytest.mark.unit
def test_clear_dir_removes_a_deep_tree_of_links_without_following_one(tmp_path, secret):
    """Removal goes through descriptors only: links at every level (to a directory and
    to a root file outside) are removed, never followed; a tree deeper than the
    descriptors it may hold (safefs.MAX_HELD_DIRS) goes too; a read-only
    directory of the sidecar's own user is made writable through its descriptor."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the tool's")
    outside.chmod(0o751)
    top = tmp_path / "top"
    level = top
    for depth in range(8 * safefs.MAX_HELD_DIRS):
        level = level / "d"
        level.mkdir(parents=True)
        if depth % 20 == 0:
            (level / "dir-link").symlink_to(outside)
            (level / "file-link").symlink_to(secret)
            (level / "f").write_text("x")
    (top / "ro" / "inner").mkdir(parents=True)
    (top / "ro" / "inner" / "f").write_text("x")
    (top / "ro").chmod(0o500)
    remove_tree(str(top))
    assert not os.path.lexists(top)
    assert (outside / "keep.txt").read_text() == "not the tool's"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o751
    _assert_untouched(secret)


@pytest.mark.unit
def test_remove_held_clears_the_moved_directory_and_only_unlinks_a_link_in_its_place(
        tmp_path):
    """The directory a descriptor holds is emptied wherever it was moved; a link put under
    its name is unlinked (its target stays), another directory put there is left."""
    outside = tmp_path / "outside"
    (outside / "h").mkdir(parents=True)
    parent = tmp_path / "root"
    parent.mkdir()
    (parent / "w").mkdir()
    (parent / "w" / "f").write_text("x")
    held = os.open(parent / "w", os.O_RDONLY | os.O_DIRECTORY)
    pfd = safefs.open_dir(str(parent))
    try:
        os.rename(parent / "w", parent / "w.moved")
        (parent / "w").symlink_to(outside)
        assert safefs.remove_held(pfd, "w", held)
        assert list((parent / "w.moved").iterdir()) == []
        assert (outside / "h").is_dir()
        os.mkdir(parent / "w")
        (parent / "w" / "theirs").write_text("x")
        assert not safefs.remove_held(pfd, "w", held)
        assert (parent / "w" / "theirs").exists()
    finally:
        os.close(pfd)
        os.close(held)


# --- unit: the sandbox ----------------------------------------------------------------------

@pytest.mark.unit
@needs_root
def test_the_sandbox_writes_its_files_before_the_tool_user_owns_the_directory(
        public_dir, secret):
    """The checkpoint is in place, 0600 and the tool's, when the directory is handed over
    (fchown of HOME, the runtime directory and the work directory, last); any write after
    that is refused instead of racing the tool's user."""
    root = public_dir()
    box = _sandbox(root, files={"checkpoint.json": '{"page": 7}'}, guard_socket=True)
    box.open()
    try:
        job_dir = Path(box.job_dir)
        for path in (job_dir, job_dir / "h", job_dir / "r", job_dir / "checkpoint.json",
                     job_dir / "guard.sock"):
            info = os.lstat(path)
            assert (info.st_uid, info.st_gid) == (TOOL_UID, TOOL_UID), path
        assert (job_dir / "checkpoint.json").read_text() == '{"page": 7}'
        assert stat.S_IMODE(os.lstat(job_dir / "checkpoint.json").st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(job_dir / "guard.sock").st_mode) == 0o600
        with pytest.raises(RuntimeError, match="already belongs to the tool's user"):
            box.write_file("late.json", "{}")
    finally:
        assert box.close() == []
    assert list(root.iterdir()) == []


@pytest.mark.e2e
@needs_root
def test_a_link_planted_by_the_tool_user_is_never_written_or_chowned_through(
        public_dir, secret):
    """The issue's input at the sandbox: once the work directory is the tool's, uid 4242
    plants ``checkpoint.json -> <root-only 0600 file>``; the sidecar then writes the
    checkpoint. It used to open(path, "w") and chown(path) through the link: the root
    file held the checkpoint and belonged to 4242."""
    root = public_dir()
    box = _sandbox(root)
    box.open()
    try:
        _as_tool("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(secret),
                 os.path.join(box.job_dir, "checkpoint.json"))
        with pytest.raises((RuntimeError, OSError)):
            box.write_file("checkpoint.json", '{"page": 7}')
    finally:
        box.close()
    _assert_untouched(secret)


@pytest.mark.e2e
@needs_root
def test_the_result_and_the_cleanup_go_through_the_directory_not_its_path(
        public_dir, tmp_path):
    """In a work root the tool's user can write (mode 0777, an emptyDir), uid 4242 moves
    a work directory away and puts a link to a root-only directory under its name (with
    a root-owned result.json and empty ``h`` and ``r``). The sidecar reads the real
    result through the directory's descriptor, and its cleanup leaves the linked
    directory whole (it used to rmdir ``h`` and ``r`` there through the link)."""
    root = public_dir(0o777)
    outside = tmp_path / "outside"
    for sub in ("h", "r"):
        (outside / sub).mkdir(parents=True)
    (outside / RESULT_FILE_NAME).write_text('{"stolen": true}')
    box = _sandbox(root)
    box.open()
    job_dir = box.job_dir
    try:
        _as_tool("import os, sys\n"
                 "open(os.path.join(sys.argv[1], 'result.json'), 'w').write('{\"real\": 1}')\n"
                 "os.rename(sys.argv[1], sys.argv[1] + '.moved')\n"
                 "os.symlink(sys.argv[2], sys.argv[1])", job_dir, str(outside))
        assert box.has_result()
        assert bytes(box.read_result(1000)) == b'{"real": 1}'
    finally:
        box.close()
    assert sorted(p.name for p in outside.iterdir()) == ["h", "r", RESULT_FILE_NAME]
    assert (outside / RESULT_FILE_NAME).read_text() == '{"stolen": true}'
    assert not os.path.lexists(job_dir), "the planted link was left in the work root"
    assert list(Path(job_dir + ".moved").iterdir()) == []  # emptied through the descriptor


@pytest.mark.e2e
@needs_root
def test_a_result_file_linked_to_a_root_file_is_not_the_result(public_dir, secret):
    root = public_dir()
    box = _sandbox(root)
    box.open()
    try:
        _as_tool("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(secret),
                 box.result_file)
        with pytest.raises(BadResult, match="cannot be read"):
            box.read_result(1000)
    finally:
        box.close()
    _assert_untouched(secret)


@pytest.mark.unit
def test_a_kept_directory_with_a_link_in_it_is_not_reused(tmp_path):
    """Reuse (no RUN_AS): a kept directory whose HOME was swapped for a link to an empty
    private directory elsewhere is not pristine; it is removed through its descriptor,
    the link's target stays."""
    from sidecar.worker import isolation
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    box = _sandbox(root, run_as="")
    box.open()
    fd, path = box.dir_lock, box.job_dir
    assert isolation._pristine(path, True, fd)
    os.rmdir(os.path.join(path, "h"))
    os.symlink(elsewhere, os.path.join(path, "h"))
    assert not isolation._pristine(path, True, fd)
    box.close()
    assert elsewhere.is_dir() and not os.path.lexists(path)


@pytest.mark.unit
def test_the_owner_lock_is_never_taken_through_a_planted_link(tmp_path, secret):
    """A tool sharing the work root plants ``.owner-<key>.lock -> <root file>``: the
    sidecar's start used to open (O_RDWR|O_CREAT) and flock the root file through it."""
    lock = OwnerLock(str(tmp_path), "owner-1")
    os.symlink(secret, lock.path)
    lock.acquire()
    try:
        info = os.lstat(lock.path)
        assert stat.S_ISREG(info.st_mode) and os.path.samestat(info, os.fstat(lock.fd))
    finally:
        lock.release()
    _assert_untouched(secret)


@pytest.mark.unit
def test_an_abandoned_directory_is_removed_without_following_its_links(tmp_path, secret):
    root = tmp_path / "root"
    work = root / f"{owner_key('gone')}.jabcdefgh"
    (work / "h").mkdir(parents=True)
    (work / "h" / "link").symlink_to(secret)
    (work / "dir-link").symlink_to(tmp_path)
    linked = root / f"{owner_key('gone')}.jlinked00"
    linked.symlink_to(tmp_path)
    assert remove_if_abandoned(str(work), 0.0)
    assert not remove_if_abandoned(str(linked), 0.0)
    assert not os.path.lexists(work) and linked.is_symlink()
    _assert_untouched(secret)


# --- the whole sidecar --------------------------------------------------------------------

def _public_tool(public_dir) -> str:
    where = public_dir()
    path = where / "link_planter.py"
    shutil.copy(TOOLS / "link_planter.py", path)
    path.chmod(0o755)
    return str(path)


def _env(dsn, work: Path, **extra):
    return base_env(dsn, SIDECAR_WORK_DIR=str(short_root(work)), SIDECAR_STAGE_TIMEOUT_SECONDS="60",
                    SIDECAR_PROFILE_LINKS_RUN_AS=f"{TOOL_UID}:{TOOL_UID}", **extra)


@pytest.mark.e2e
@needs_root
def test_f15_a_sibling_cannot_get_the_checkpoint_written_through_its_link(
        dsn, public_dir, secret):
    """Case F15, the issue's input: RUN_AS=4242:4242, --concurrency 2. One tool plants
    ``checkpoint.json -> <root-only 0600 file>`` in every work directory of its user that
    appears; its sibling is retried with a checkpoint five times. The root file keeps its
    content and its owner, and the retried job resumes from its real checkpoint."""
    work = public_dir()
    signals = public_dir(0o777)
    stop = str(signals / "stop")
    env = _env(dsn, work)
    tool = _public_tool(public_dir)
    planter = enqueue(dsn, "links", {"mode": "plant", "target": str(secret), "stop": stop},
                      "--max-attempts", "1", env=env)
    resumed = enqueue(dsn, "links", {"mode": "resume", "attempts": 6, "stop": stop},
                      "--max-attempts", "6", env=env)
    done = cli(dsn, "run", "--tool", "links", "--concurrency", "2", "--drain", "--",
               "/usr/bin/python3", tool, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    _assert_untouched(secret)
    row = job_row(dsn, resumed)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"resumed_from": {"attempt": 5}}
    assert job_row(dsn, planter)["state"] == "succeeded"
    assert list(work.iterdir()) == []


@pytest.mark.e2e
@needs_root
def test_f15_a_swapped_sibling_work_dir_changes_neither_the_result_nor_the_cleanup(
        dsn, public_dir, tmp_path):
    """Case F15 in a work root the tool's user can write (0777, what an emptyDir is): one
    tool moves its sibling's work directory away and links a root-only directory (holding
    a root ``result.json`` and empty ``h`` and ``r``) under its name. The sibling's real
    result is committed, and the linked directory is left whole."""
    work = public_dir(0o777)
    signals = public_dir(0o777)
    outside = tmp_path / "outside"
    for sub in ("h", "r"):
        (outside / sub).mkdir(parents=True)
    (outside / RESULT_FILE_NAME).write_text('{"stolen": true}')
    env = _env(dsn, work)
    tool = _public_tool(public_dir)
    marks = {"ready": str(signals / "ready"), "swapped": str(signals / "swapped")}
    victim = enqueue(dsn, "links", {"mode": "victim", **marks}, "--max-attempts", "1",
                     env=env)
    swapper = enqueue(dsn, "links", {"mode": "swap", "outside": str(outside), **marks},
                      "--max-attempts", "1", env=env)
    done = cli(dsn, "run", "--tool", "links", "--concurrency", "2", "--drain", "--",
               "/usr/bin/python3", tool, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert job_row(dsn, swapper)["state"] == "succeeded"
    row = job_row(dsn, victim)
    assert (row["state"], row["result"]) == ("succeeded", {"real": True}), row["error"]
    assert sorted(p.name for p in outside.iterdir()) == ["h", "r", RESULT_FILE_NAME]
    assert (outside / RESULT_FILE_NAME).read_text() == '{"stolen": true}'
    left = [p for p in work.iterdir() if not p.name.startswith(".")]
    # At most the moved directory, emptied through its descriptor (the owner's sweep
    # may have removed it since: its name still starts with the owner key).
    assert all(p.name.endswith(".moved") and not any(p.iterdir()) for p in left), left

