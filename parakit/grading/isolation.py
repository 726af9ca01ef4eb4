"""The operating system's walls around a student's rank: Linux namespaces, a filesystem
view of its own, no new processes, and resource caps.

`confine(scratch, ...)` runs in a freshly forked rank before any student line, and makes the
process, for good:
- its own PID namespace (the rank is process 1 there: it sees no other process, cannot
  signal the judge, its zygote or another rank, and when it ends every process it made ends
  with it), its own network namespace (no interface but a loopback that is down) and IPC
  namespace (no System V queue or segment shared with anyone);
- a root of its own (`pivot_root` into a tmpfs, read-only): the system's /usr, /lib, /bin
  and Python's prefix and the virtual environment, read-only; a fresh /proc, /tmp and
  /dev/shm (private to the rank); /dev/null, zero, random, urandom; its scratch folder, the
  one place it may write, at the scratch folder's path but a tmpfs of its own (`Limits.scratch_size`:
  a rank that writes past it gets ENOSPC, and the disk under the grader never fills). The course's files, parakit's source, the solutions, the other
  submissions and the other ranks' folders are not there at all;
- no capability, no new privileges, and a seccomp filter that refuses every way to start a
  process (fork, vfork, clone without CLONE_THREAD, clone3 (answered ENOSYS, so threads fall
  back to clone), execve, execveat) and every way to change the view (mount, umount,
  pivot_root, chroot, unshare, setns, the new mount API), ptrace and the process_vm calls;
- capped: address space, CPU seconds, file size, open files, bytes in its scratch, /tmp and /dev/shm.

The rank's sockets opened before (its link to the judge's broker) keep working: a
connected socket belongs to no namespace's lookup. The caller forks once more after
`unshare` (`enter_pid_namespace`), since only a process's children enter a new PID
namespace. `unavailable()` says why this cannot run here (not Linux, not root, no
namespaces), so that grading can say loudly that its grades are not sealed.

Python's audit hook (`jail`) stays as the second wall, inside this one.
"""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
import sys

__all__ = ["unavailable", "enter_pid_namespace", "confine", "Limits"]

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x20000, 0x08000000, 0x40000000, 0x20000000
CLONE_THREAD = 0x10000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
O_PATH = 0o10000000

# syscall numbers: (x86_64, aarch64); None where the architecture has no such call
_CALLS = {
    "fork": (57, None), "vfork": (58, None), "execve": (59, 221), "execveat": (322, 281), "clone": (56, 220),
    "clone3": (435, 435), "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "unshare": (272, 97), "setns": (308, 268),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "io_uring_setup": (425, 425),
    "userfaultfd": (323, 282), "bpf": (321, 280), "perf_event_open": (298, 241), "keyctl": (250, 219),
}
_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in _CALLS, AUDIT_ARCH_*
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
DEVICES = ("null", "zero", "random", "urandom", "full")


class Limits:
    """Per-rank caps: bytes of address space beyond what the rank maps when confined, CPU
    seconds, bytes in one written file, open files, bytes in the rank's /tmp and /dev/shm (each),
    bytes in its scratch folder (all its files together)."""

    def __init__(self, memory: int = 4 * 2**30, cpu_seconds: int = 900, file_size: int = 8 * 2**20,
                 open_files: int = 256, tmp_size: int = 64 * 2**20, scratch_size: int = 256 * 2**20):
        self.memory, self.cpu_seconds, self.file_size = memory, cpu_seconds, file_size
        self.open_files, self.tmp_size, self.scratch_size = open_files, tmp_size, scratch_size


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} on {target}")


def unavailable() -> str | None:
    """Why a rank cannot be confined on this machine, or None where it can."""
    if sys.platform != "linux":
        return f"{sys.platform} has no Linux namespaces"
    if platform.machine() not in _ARCH:
        return f"no seccomp filter written for {platform.machine()}"
    if os.geteuid() != 0:
        return "the grader does not run as root, which mount and PID namespaces need here"
    for name in ("mnt", "pid", "net", "ipc"):
        if not os.path.exists(f"/proc/self/ns/{name}"):
            return f"the kernel has no {name} namespaces"
    return None


def enter_pid_namespace() -> int:
    """unshare the mount, PID, network and IPC namespaces, then fork: in the child (process 1
    of the new PID namespace) return 0; in the caller return the child's pid."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
    return os.fork()


def confine(scratch: str, visible: list[str], hidden: list[str], limits: Limits) -> None:
    """Make this process (process 1 of its PID namespace, from `enter_pid_namespace`) see only
    the system, `visible` (read-only: Python's prefix, the venv; also by the link it is named by)
    and, at `scratch`'s path, a tmpfs of `limits.scratch_size` bytes (read-write and empty: what
    the folder holds, the rank's output file, stays outside, on the descriptors opened before);
    `hidden` folders inside those (parakit's own package, say) are covered by empty ones.
    Then drop every capability, filter the system calls and set the caps (see the module)."""
    scratch = os.path.realpath(scratch)
    binds = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    binds += sorted({os.path.realpath(p) for p in visible if os.path.isdir(p)} - set(binds))
    links = {os.path.abspath(p): os.path.realpath(p) for p in visible  # a venv reached by a link
             if os.path.isdir(p) and os.path.abspath(p) != os.path.realpath(p)}
    held = {path: os.open(path, O_PATH | os.O_DIRECTORY) for path in binds}  # reachable once /tmp is covered
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"  # a tmpfs over it becomes the new root; the old /tmp is out of sight
    _mount("sealed", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for folder in ("/tmp", "/dev/shm"):  # first: what is bound below them (a venv in /tmp) lands on these
        os.makedirs(root + folder)
        _mount("scratch", root + folder, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={limits.tmp_size}")
    for source in binds:
        _bind(f"/proc/self/fd/{held[source]}", root + source, read_only=True)
    os.makedirs(root + scratch, exist_ok=True)
    _mount("scratch", root + scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={limits.scratch_size}")
    for fd in held.values():
        os.close(fd)
    for link in (d for d in SYSTEM_DIRS if os.path.islink(d)):
        os.symlink(os.readlink(link), root + link)
    for path, target in links.items():  # sys.path names the folder so: the link leads to where it is bound
        if not os.path.lexists(root + path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(target, root + path)
    for folder in hidden:
        folder = os.path.realpath(folder)
        if any(folder.startswith(b + "/") for b in binds) and os.path.isdir(root + folder):
            _mount("hidden", root + folder, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k")
    for name in DEVICES:
        _bind(f"/dev/{name}", f"{root}/dev/{name}", read_only=False)
    for folder in ("proc", "old"):
        os.makedirs(f"{root}/{folder}", exist_ok=True)
    _check(_libc.syscall(_number("pivot_root"), root.encode(), f"{root}/old".encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/old", MNT_DETACH), "umount the old root")
    os.rmdir("/old")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(scratch)
    _limit(limits)
    _drop_capabilities()
    _filter_system_calls()


def _bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit(limits: Limits) -> None:
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    for which, value in ((resource.RLIMIT_AS, mapped + limits.memory), (resource.RLIMIT_CPU, limits.cpu_seconds),
                         (resource.RLIMIT_FSIZE, limits.file_size), (resource.RLIMIT_NOFILE, limits.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def _drop_capabilities() -> None:
    """Out of the bounding set, then effective, permitted and inheritable all empty."""
    PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    _check(_libc.capset(header, data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _number(name: str) -> int:
    return _CALLS[name][_ARCH[platform.machine()][0]]


def _filter_system_calls() -> None:
    """A seccomp BPF program: the wrong architecture is killed, x32 numbers refused; clone is let through only
    with CLONE_THREAD; clone3 answers ENOSYS; the calls of the module's list answer EPERM."""
    column, arch = _ARCH[platform.machine()]
    deny = [n[column] for name, n in _CALLS.items() if name not in ("clone", "clone3") and n[column] is not None]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # x32's numbers
    prog += [(JEQ, 0, 1, _number("clone3")), (RET, 0, 0, ENOSYS)]
    prog += [(JEQ, 0, 4, _number("clone")), (LD, 0, 0, 16), (JSET, 0, 1, CLONE_THREAD), (RET, 0, 0, ALLOW),
             (RET, 0, 0, EPERM)]
    for number in deny:
        prog += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    prog.append((RET, 0, 0, ALLOW))
    filters = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buffer))
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")
