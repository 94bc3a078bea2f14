"""Unit tests of the objects a Worker owns instead of module globals: the process table
(sidecar.worker.child.ProcessTable: managed and exempt pids, spawn generation and in-flight
count, live attempts, the reap lock, the spawn threads) and the pool of kept work
directories (sidecar.worker.isolation.SparePool). Nothing here spawns a process or needs the
database; the end-to-end tests (test_child_process, test_leftovers, test_spawn_path)
cover the same rules through real tools.
"""

from __future__ import annotations

import os
import threading

import pytest

from sidecar.runtime.config import load_settings
from sidecar.worker import safefs
from sidecar.worker.child import ProcessTable, find_tree
from sidecar.worker.claim_loop import Worker
from sidecar.worker.isolation import HOME_DIR_NAME, RUNTIME_DIR_NAME, SparePool, lock_directory

pytestmark = pytest.mark.unit

# --- the process table ------------------------------------------------------------------


def test_a_pid_is_its_own_while_managed_or_exempt():
    table = ProcessTable()
    assert not table.is_own(4242)
    table.manage(4242)
    assert table.is_own(4242)
    table.unmanage(4242)
    table.unmanage(4242)  # a second discard (Popen and the pidfd both saw the exit) is fine
    assert not table.is_own(4242)
    table.exempt(4343)  # the guardian: never a tool's, never reaped as an orphan
    assert table.is_own(4343)


def test_tables_share_nothing():
    one, other = ProcessTable(), ProcessTable()
    one.manage(10)
    one.exempt(11)
    one.spawn_begun()
    one.attempt_started()
    assert not other.is_own(10) and not other.is_own(11)
    assert other.spawn_mark() == (0, True) and other.live_attempts == 0


def test_a_scan_sees_a_spawn_that_began_or_is_in_flight_while_it_listed():
    """Case F7/F9: a child between fork and exec carries the sidecar's environment; a
    scan claims unmarked processes only while no spawn is in flight and none began since
    its mark."""
    table = ProcessTable()
    generation, quiet = table.spawn_mark()
    assert quiet and not table.spawn_moved(generation)
    table.spawn_begun()
    assert table.spawn_moved(generation)  # began since the mark, and is in flight
    assert table.spawn_mark()[1] is False
    table.spawn_done()
    generation, quiet = table.spawn_mark()
    assert quiet and not table.spawn_moved(generation)
    table.spawn_begun()
    table.spawn_done()  # over before the scan ended: the generation still moved
    assert table.spawn_moved(generation)


def test_spawn_counts_from_many_threads_balance():
    table = ProcessTable()

    def spawns() -> None:
        for _ in range(1000):
            table.spawn_begun()
            table.spawn_done()

    threads = [threading.Thread(target=spawns) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert table.spawn_mark() == (4000, True)


@pytest.mark.skipif(os.getpid() == 1, reason="as PID 1 no attempt is ever alone")
def test_an_attempt_is_alone_only_while_it_is_the_only_live_one():
    table = ProcessTable()
    assert not table.alone()
    table.attempt_started()
    assert table.alone() and table.live_attempts == 1
    table.attempt_started()
    assert not table.alone()
    table.attempt_ended()
    assert table.alone()
    table.attempt_ended()
    assert table.live_attempts == 0 and not table.alone()


def test_the_reaper_waits_for_a_spawn_in_progress():
    """Case F9: reap_adopted takes the reap lock a spawn holds from before its fork
    until its pid is managed, so it never sees that child unrecorded."""
    table = ProcessTable(subreaper=True)
    reaped: list[int] = []
    with table.reap_lock:
        reaper = threading.Thread(target=lambda: reaped.append(table.reap_adopted()))
        reaper.start()
        reaper.join(0.2)
        assert reaper.is_alive() and reaped == []
    reaper.join(10)
    assert reaped == [0]  # this test process has no zombie child of its own


def test_one_spawn_thread_per_kind_and_only_the_default_one_forbids_new_privileges():
    """Case F23: tools start from a thread with no_new_privs; ALLOW_NEW_PRIVS from a second
    one without it. Each is made once, at its first use, and kept."""
    table = ProcessTable()
    plain, privileged = table.spawn_thread(False), table.spawn_thread(True)
    assert table.spawn_thread(False) is plain and table.spawn_thread(True) is privileged
    assert plain is not privileged
    assert ProcessTable().spawn_thread(False) is not plain

    def no_new_privs() -> str:
        with open("/proc/thread-self/status") as f:
            return next(line.split()[1] for line in f if line.startswith("NoNewPrivs:"))

    if os.path.exists("/proc/thread-self/status"):
        assert plain.submit(no_new_privs).result(10) == "1"
        assert privileged.submit(no_new_privs).result(10) == no_new_privs()


def test_find_tree_refuses_an_empty_cookie_whatever_the_table():
    for table in (None, ProcessTable(), ProcessTable(subreaper=True)):
        with pytest.raises(ValueError):
            find_tree(os.getpid(), {}, processes=table)


# --- the pool of kept work directories ---------------------------------------------------


def _kept_dir(root: str, with_home: bool = True) -> tuple[str, int]:
    """A work directory as Sandbox makes it: 0700, locked, HOME and runtime dirs empty."""
    root_fd = safefs.open_dir(root)
    try:
        name, fd = safefs.make_private_dir(root_fd, "abcdefabcdef.j")
    finally:
        os.close(root_fd)
    lock_directory(fd)
    if with_home:
        for sub in (HOME_DIR_NAME, RUNTIME_DIR_NAME):
            os.mkdir(sub, 0o700, dir_fd=fd)
    return os.path.join(root, name), fd


def test_a_pool_keeps_at_most_its_limit_per_key(tmp_path):
    pool = SparePool(limit=2)
    key = (str(tmp_path), "abcdefabcdef.j", True)
    dirs = [_kept_dir(str(tmp_path)) for _ in range(3)]
    assert pool.keep(key, *dirs[0]) and pool.keep(key, *dirs[1])
    assert not pool.keep(key, *dirs[2])  # full: the caller still owns it
    other = (str(tmp_path), "abcdefabcdef.j", False)
    assert pool.keep(other, *_kept_dir(str(tmp_path), with_home=False))  # another key
    assert len(pool) == 3
    pool.close()
    os.close(dirs[2][1])


def test_a_pool_gives_back_a_pristine_directory_with_its_lock(tmp_path):
    pool = SparePool()
    key = (str(tmp_path), "abcdefabcdef.j", True)
    path, fd = _kept_dir(str(tmp_path))
    assert pool.keep(key, path, fd)
    assert pool.take((str(tmp_path), "abcdefabcdef.j", False)) is None  # another key
    assert pool.take(key) == (path, fd)
    assert pool.take(key) is None and len(pool) == 0
    os.close(fd)


def test_a_touched_directory_is_removed_or_handed_back_as_stale(tmp_path):
    pool = SparePool()
    key = (str(tmp_path), "abcdefabcdef.j", True)
    path, fd = _kept_dir(str(tmp_path))
    assert pool.keep(key, path, fd)
    safefs.create_file(fd, "left-over", b"x")
    assert pool.take(key) is None  # removed here, through its descriptor
    assert not os.path.lexists(path)

    path, fd = _kept_dir(str(tmp_path))
    assert pool.keep(key, path, fd)
    os.rmdir(os.path.join(path, HOME_DIR_NAME))
    stale: list[tuple[str, int]] = []
    assert pool.take(key, stale) is None  # left to the caller: not removed on the loop
    assert stale == [(path, fd)] and os.path.isdir(path)
    safefs.remove_held_path(path, fd)
    os.close(fd)


def test_a_closed_pool_removes_what_it_kept_and_keeps_nothing_more(tmp_path):
    pool = SparePool()
    key = (str(tmp_path), "abcdefabcdef.j", True)
    kept = [_kept_dir(str(tmp_path)) for _ in range(2)]
    for path, fd in kept:
        assert pool.keep(key, path, fd)
    pool.close()
    assert not [path for path, _ in kept if os.path.lexists(path)]
    late = _kept_dir(str(tmp_path))
    assert not pool.keep(key, *late)
    pool.close()  # twice: nothing left to do
    assert os.path.isdir(late[0])
    safefs.remove_held_path(*late)
    os.close(late[1])


# --- who owns them ----------------------------------------------------------------------


def test_a_worker_owns_its_pool_and_uses_the_process_table_it_is_given():
    settings = load_settings({})
    profile = settings.profile("t")
    one = Worker(settings, profile, "postgresql://unused", ["/bin/true"])
    other = Worker(settings, profile, "postgresql://unused", ["/bin/true"])
    assert one.spares is not other.spares
    assert one.processes is not other.processes and not one.processes.subreaper
    shared = ProcessTable(subreaper=True)
    given = Worker(settings, profile, "postgresql://unused", ["/bin/true"], processes=shared)
    assert given.processes is shared
