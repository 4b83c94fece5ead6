"""Writing the user's files without harming them: checked targets, atomic replace, the user's umask.

Every file attnexport writes (models, golden cases, baselines, plots) goes through here:
- a target that exists must be a regular file: a device, a FIFO or a folder is refused (exit 2);
  a symbolic link is written through, so the link stays and its target gets the new content;
- the target's folder must exist (through a link too): a typo in a path is an error, not a new
  tree of folders; only the default output folder, `models/`, is made when it is missing;
- the data goes to a short temporary name in the target's folder, then is renamed into place,
  so an interrupted write (Ctrl-C included) leaves the old file or none, never half of one;
- the new file gets the mode a plain `open(path, "w")` would give (0666 less the umask), or
  keeps the mode of the file it replaces.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from attnexport.errors import UsageError


def resolve_target(path: str | Path, new_folder: bool = False) -> Path:
    """The path to write for `path`, checked before any work: UsageError when it cannot be written.
    Its folder must exist, except `models/` and, with `new_folder`, one new folder in an existing one."""
    path = given = Path(path)
    if len(path.name.encode()) > 255:
        raise UsageError(f"cannot write {path}: the file name is longer than 255 bytes")
    if path.is_symlink():
        path = Path(os.path.realpath(path))  # write through the link, keep it
    if path.exists():
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"cannot write {path}: it is a folder")
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) \
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
            raise UsageError(f"refusing to write {path}: it is {kind}, not a regular file")
    parent = path.parent
    if not parent.exists() and parent.parent.is_dir() and (new_folder or parent.resolve() == DEFAULT_FOLDER.resolve()):
        # The default output folder (given or not), or a folder the command makes by design
        # (--save-baseline DIR): one level is made, never a tree.
        try:
            parent.mkdir()
        except OSError as e:
            raise UsageError(f"cannot make the folder {parent}: {e.strerror or e}") from None
    if not parent.exists():
        through = f" ({given} is a link to {path})" if given != path else ""
        raise UsageError(f"cannot write {given}: its folder {parent} does not exist{through}")
    if not parent.is_dir():
        raise UsageError(f"cannot write {given}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {given}: the folder {parent} is not writable")
    try:  # the real test (root passes os.access everywhere; a read-only mount or /proc does not)
        fd, probe = tempfile.mkstemp(prefix=".attnexport-", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {given}: the folder {parent} does not take new files "
                         f"({e.strerror or e})") from None
    return path


# What protobuf can hold in one message: a graph with more weights inside it cannot be written or
# given to ONNX Runtime whole.
PROTOBUF_LIMIT = (1 << 31) - 1


def fits_one_message(model) -> None:
    """A UsageError where the ModelProto `model` is above what one protobuf message holds, naming
    its size and the way out (its weights beside the graph), rather than protobuf's EncodeError."""
    size = model.ByteSize()
    if size > PROTOBUF_LIMIT:
        raise UsageError(f"the model is {human_size(size)} as one message, above the 2 GB protobuf holds: write its "
                         "weights beside the graph (export --external-data)")


def human_size(n: int) -> str:
    """A file's size in the one unit style every command prints: B, KiB, MiB or GiB."""
    if n < 1024:
        return f"{n} B"
    if n < 1024**3:
        return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024**3:.2f} GiB"


DEFAULT_FOLDER = Path("models")


def default_output(stem: str) -> Path:
    """`models/<stem>.onnx`, the default output of an export (its folder is made when written)."""
    return DEFAULT_FOLDER / f"{stem}.onnx"


def atomic_write(path: str | Path, data: bytes) -> Path:
    """Writes `data` to `path` atomically (see the module docstring); returns the path written.

    The temporary file is made with mode 0666, which the user's umask reduces as for any new file
    (the process's umask is never changed: another thread may be making a file), takes the mode
    of the file it replaces, and is flushed to the disk before the rename, so a crash after it
    leaves the new content, not an empty file."""
    path = resolve_target(path)
    try:
        keep = stat.S_IMODE(path.stat().st_mode) if path.exists() else None
        fd, tmp = _new_temporary(path.parent)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep is not None:
            os.chmod(tmp, keep)
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    return path


def _new_temporary(folder: Path) -> tuple[int, str]:
    """A new file with a short unused name in `folder` (one derived from a long target name can
    exceed NAME_MAX), opened for writing with mode 0666 under the umask."""
    for _ in range(100):
        name = os.path.join(folder, f".attnexport-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name in {folder}")


def _sync_folder(folder: Path) -> None:
    """Flushes the folder's entry of the renamed file to the disk, where the system allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is done
    finally:
        os.close(fd)


def deploy_target(folder: Path, option: str = "--deploy") -> Path:
    """A folder to be written (`write_folder`), checked before any work: a folder or nothing yet
    (then its parent must exist: one level is made, never a tree), writable."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{option} {folder}: it is a file, not a folder")
    if not folder.exists() and not folder.parent.is_dir():
        raise UsageError(f"{option} {folder}: its folder {folder.parent} does not exist")
    target = folder if folder.exists() else folder.parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {folder}: {target} is not writable")
    return folder


def write_folder(folder: Path, fill) -> None:
    """`fill(staging)` writes the folder's files into a temporary folder beside it; a new folder is
    then renamed into place whole, an existing one gets each file renamed over its own (a link is
    written through, and stays), so an interrupted run leaves no half-written file. The folder made
    has the mode a plain mkdir gives under the user's umask."""
    staging = Path(tempfile.mkdtemp(prefix=".attnexport-", dir=folder.parent if not folder.exists() else folder))
    os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700: the folder a plain mkdir would make
    try:
        fill(staging)
        if not folder.exists():
            os.replace(staging, folder)
            return
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = folder / path.relative_to(staging)
            if not target.parent.exists():
                target.parent.mkdir()
            if target.is_symlink():
                atomic_write(target, path.read_bytes())  # through the link, which stays
            else:
                resolve_target(target)
                os.replace(path, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# External data: a whole model's weights in one file beside its graph, named after it
# (`model.onnx` -> `model.onnx_data`, the name Optimum and transformers.js read). Each tensor of
# EXTERNAL_MIN bytes or more starts at a multiple of EXTERNAL_ALIGN, so that ONNX Runtime maps it
# in place rather than reading a copy (the allocation granularity: the page here, 64 KiB on Windows).
EXTERNAL_MIN = 1024
EXTERNAL_ALIGN = 1 << 16


def data_file(graph: str | Path) -> Path:
    """The external data file of the graph at `graph`: beside it, its name + `_data`."""
    graph = Path(graph)
    return graph.with_name(graph.name + "_data")


class Staged:
    """A graph and its external data written to a temporary folder beside their targets (see
    `stage_external`): `graph` is what a check loads; `commit()` renames both into place (the data
    first, so the graph in place never names data that is not there yet), `discard()` removes them."""

    def __init__(self, folder: Path, target: Path, size: int):
        self.folder, self.target, self.size = folder, target, size
        self.graph = folder / target.name
        self.data = data_file(self.graph)
        self._flush: tuple | None = None

    def flushing(self, path: Path) -> None:
        """`path` flushed to the disk on a thread of its own from now (most of a large data file's
        flush, a second of a 4 GB one here, then overlaps its check); `commit` waits for it and
        says its error (a disk that fills only as the file's blocks are allocated)."""
        import threading
        result: list = []

        def flush():
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                result.append(e)
        thread = threading.Thread(target=flush, name="attnexport-flush", daemon=True)
        thread.start()
        self._flush = (thread, result)

    def commit(self) -> Path:
        try:
            if self._flush is not None:
                thread, result = self._flush
                thread.join()
                if result:
                    raise result[0]
            for staged, target in ((self.data, data_file(self.target)), (self.graph, self.target)):
                real = resolve_target(target)  # through a link, which stays; never over a device or a FIFO
                if real.exists():
                    os.chmod(staged, stat.S_IMODE(real.stat().st_mode))
                os.replace(staged, real)
            _sync_folder(self.target.parent)
        except OSError as e:
            raise UsageError(f"cannot write {self.target}: {e.strerror or e}") from None
        finally:
            self.discard()
        return self.target

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def new_staging(target: str | Path) -> Staged:
    """A new temporary folder beside `target` for it and its external data (`stage_external`), both
    targets checked first (UsageError where they cannot be written)."""
    target = resolve_target(target)
    resolve_target(data_file(target))
    folder = Path(tempfile.mkdtemp(prefix=".attnexport-", dir=target.parent))
    return Staged(folder, target, 0)


# A staging folder's scratch file: the weights a trace wrote straight from the module's tensors, which
# the model in memory names until it is staged (`stage_external` copies them into the data file).
SCRATCH = "traced.weights"


def stage_external(model, target: str | Path, staged: Staged | None = None) -> Staged:
    """Writes `model` as a graph and its external data (`data_file`) into a new temporary folder
    beside `target` (or `staged`'s), each tensor of EXTERNAL_MIN bytes or more moved out of the
    model in memory as it is written (the model then names the data file: its weights are held
    once, on disk); a tensor the model already holds outside it (in the staging folder's SCRATCH
    file, or another file of that folder) is copied over one at a time, except where the SCRATCH
    file is still nearly all the graph's: it is then renamed to the data file and the rest appended
    (`_adopt_scratch`: the weights are written once, not twice). Both files are flushed to
    the disk. Nothing is left when the write fails (a full disk): the folder is removed and the
    error is a UsageError."""
    import onnx

    staged = staged or new_staging(target)
    target = staged.target
    location = data_file(target).name
    try:
        adopted = _adopt_scratch(model, staged)
        if adopted:
            fd = os.open(staged.data, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        else:
            fd = os.open(staged.data, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            f.seek(0, os.SEEK_END)
            for init in model.graph.initializer:
                if adopted and _location(init) == SCRATCH:
                    _set_external(init, location=location)  # its bytes are in the file, which was renamed
                    continue
                if init.data_location == onnx.TensorProto.EXTERNAL:
                    data = None  # copied by the kernel from the file that holds it, never read in here
                elif init.HasField("raw_data"):
                    data = init.raw_data
                    if len(data) < EXTERNAL_MIN:
                        continue
                else:
                    continue
                f.write(b"\0" * (-f.tell() % EXTERNAL_ALIGN))
                offset = f.tell()
                if data is None:
                    length = _copy_external(init, staged.folder, f)
                else:
                    f.write(data)
                    length = len(data)
                init.ClearField("raw_data")
                init.data_location = onnx.TensorProto.EXTERNAL
                del init.external_data[:]
                for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
                    entry = init.external_data.add()
                    entry.key, entry.value = key, value
                del data
            f.flush()
            size = f.tell()
        staged.flushing(staged.data)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged.folder / SCRATCH)
        graph = model.SerializeToString(deterministic=True)
        fd = os.open(staged.graph, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(graph)
            f.flush()
            os.fsync(f.fileno())
        staged.size = size + len(graph)
    except BaseException as e:
        staged.discard()
        if isinstance(e, OSError):
            raise UsageError(f"cannot write {target}: {e.strerror or e}") from None
        raise
    return staged


# The scratch file becomes the data file itself (renamed, not copied: a second write of every weight)
# where the graph still names nearly all of it. The tensors it no longer names (the tied embedding the
# head now reads transposed, the float matrices a quantized graph replaced) leave holes; the last
# tensors are moved into them (`_compacted`) while that moves less than half of what a copy would
# write, and what is still unused must be below SCRATCH_UNUSED of the file; else the tensors the graph
# names are copied into a new file.
SCRATCH_UNUSED = 1 / 64


def _location(init) -> str | None:
    if init.data_location != 1:  # onnx.TensorProto.EXTERNAL
        return None
    return next((e.value for e in init.external_data if e.key == "location"), None)


def _set_external(init, **fields) -> None:
    for e in init.external_data:
        if e.key in fields:
            e.value = str(fields[e.key])


def _compacted(ranges: list[tuple[int, int]]) -> tuple[dict[tuple[int, int], int], int]:
    """Where to move tensors of a file that holds `ranges` (offset, length; sorted, disjoint) so
    that the last ones fill the holes before them: ({range: new offset}, the file's new end). From
    the last tensor back, each goes to the first hole before it that holds it (at EXTERNAL_ALIGN),
    until one fits none."""
    holes, end = [], 0
    for offset, length in ranges:
        start = end + (-end % EXTERNAL_ALIGN)
        if start < offset:
            holes.append([start, offset])
        end = offset + length
    moves: dict[tuple[int, int], int] = {}
    stays = 0
    for k in range(len(ranges) - 1, 0, -1):
        offset, length = ranges[k]
        hole = next((h for h in holes if h[0] < offset and h[0] + length <= h[1]), None)
        if hole is None:
            stays = k
            break
        moves[(offset, length)] = hole[0]
        hole[0] += length + (-length % EXTERNAL_ALIGN)
    return moves, max([sum(ranges[stays]), *(at + n for (_, n), at in moves.items())])


def _adopt_scratch(model, staged: Staged) -> bool:
    """Renames the staging folder's SCRATCH file to the data file (the trace wrote the weights
    once, and that write is kept) where the graph still names nearly all of it, its last tensors
    moved into the holes the others left (see SCRATCH_UNUSED). False where it is not so: the
    caller copies what the graph names into a new file."""
    scratch = staged.folder / SCRATCH
    try:
        size = scratch.stat().st_size
    except FileNotFoundError:
        return False
    named: dict[tuple[int, int], list] = {}
    for init in model.graph.initializer:
        if _location(init) != SCRATCH:
            continue
        info = {e.key: e.value for e in init.external_data}
        offset = int(info.get("offset", 0))
        if "length" not in info or offset % EXTERNAL_ALIGN:
            return False
        named.setdefault((offset, int(info["length"])), []).append(init)
    ranges = sorted(named)
    if not ranges or any(a[0] + a[1] > b[0] for a, b in zip(ranges, ranges[1:], strict=False)):  # none, or overlapping
        return False
    used = sum(n for _, n in ranges)
    moves, end = _compacted(ranges)
    moved = sum(n for _, n in moves)
    if moved > used / 2 or end - used > EXTERNAL_ALIGN * len(ranges) + SCRATCH_UNUSED * size:
        return False
    fd = os.open(scratch, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        for (offset, length), at in sorted(moves.items(), key=lambda m: m[1]):
            _copy_range(fd, offset, at, length)
            for init in named[(offset, length)]:
                _set_external(init, offset=at)
        os.ftruncate(fd, end)
    finally:
        os.close(fd)
    os.replace(scratch, staged.data)
    return True


def _copy_range(fd: int, offset: int, at: int, length: int) -> None:
    """Copies `length` bytes of the file at `offset` to `at` (ranges that do not overlap), by the
    kernel where it can (`os.copy_file_range`), else 16 MiB at a time."""
    with contextlib.suppress(OSError):
        while length > 0:
            n = os.copy_file_range(fd, fd, min(length, 1 << 30), offset, at)
            if n == 0:
                break
            offset, at, length = offset + n, at + n, length - n
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 24), offset)
        if not chunk:
            raise OSError(errno.EIO, "the scratch file ends early")
        os.pwrite(fd, chunk, at)
        offset, at, length = offset + len(chunk), at + len(chunk), length - len(chunk)


def _copy_external(init, folder: Path, f) -> int:
    """Appends the bytes of `init` (held as external data in a file of `folder`) to `f`, copied by
    the kernel a range at a time (`os.copy_file_range`: nothing of a whole model's weights passes
    through the process; read and written in chunks where the filesystem does not serve it);
    returns how many."""
    info = {e.key: e.value for e in init.external_data}
    offset = int(info.get("offset", 0))
    with open(folder / info["location"], "rb") as src:
        length = int(info["length"]) if "length" in info else os.fstat(src.fileno()).st_size - offset
        f.flush()
        out, left = f.tell(), length
        with contextlib.suppress(OSError):  # EXDEV, ENOSYS, EINVAL: the chunks below do the rest
            while left > 0:
                n = os.copy_file_range(src.fileno(), f.fileno(), min(left, 1 << 30), offset, out)
                if n == 0:
                    break
                offset, out, left = offset + n, out + n, left - n
        f.seek(out)
        src.seek(offset)
        while left > 0:
            chunk = src.read(min(left, 1 << 24))
            if not chunk:
                raise OSError(errno.EIO, f"{init.name}: its external data ends {left} bytes early")
            f.write(chunk)
            left -= len(chunk)
    return length


def umask() -> int:
    """The process's umask, read from /proc (setting it to read it would race other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
