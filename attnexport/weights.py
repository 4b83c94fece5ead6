"""Parameters in and out of ONNX files: validation, sha256 fingerprints, recovery from initializers.

The exporter folds a parameter into an initializer of its own name (a bias) or of a generated
name, transposed (a Linear weight read by MatMul). At export, each parameter is found among the
initializers and recorded in the metadata with its initializer, layout and the sha256 of the
stored bytes. `verify` then recomputes the hashes from the file: a changed weight is named before
any number is compared, and the parameters it runs the reference with are the model's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from attnexport import files as F
from attnexport import schema
from attnexport.errors import UsageError
from attnexport.record import ExportRecord, as_json

LAYOUTS = ("as-is", "transposed")


def sha256_of(arr: np.ndarray, scratch: Scratch | None = None) -> str:
    """sha256 of an array's dtype, shape and bytes (C order, little-endian); one that is not
    contiguous (a transposed view) is hashed a block of rows at a time, never copied whole (in
    `scratch`'s buffer where one is given)."""
    a = np.asarray(arr)
    h = hashlib.sha256(_header(a.dtype, a.shape))
    if a.flags.c_contiguous or a.ndim == 0:
        h.update(_bytes_of(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)))
    else:
        for block in row_blocks(a.astype(a.dtype.newbyteorder("<"), copy=False), CHUNK_BYTES, scratch):
            h.update(block)
    return h.hexdigest()


def _header(dtype, shape) -> bytes:
    """What `sha256_of` hashes before an array's bytes: its type and shape."""
    return f"{_dtype_str(dtype)}{tuple(int(d) for d in shape)}".encode()


class Scratch:
    """One buffer that `row_blocks` makes blocks contiguous in, grown to the largest block asked for
    and reused from array to array. A fresh buffer per array is memory the kernel hands out page by
    page: 0.54 GB of transposed weights (8192 x 2048) made contiguous 64 MiB at a time took 1.5 s into a
    fresh buffer per matrix (0.4 s once the allocator had such blocks to hand back), 0.19 s into one
    reused buffer."""

    def __init__(self):
        self._bytes = None

    def take(self, n: int, dtype):
        """`n` elements of torch dtype `dtype`, valid until the next call."""
        import torch
        size = n * dtype.itemsize
        if self._bytes is None or self._bytes.numel() < size:
            self._bytes = torch.empty(size, dtype=torch.uint8)
        return self._bytes[:size].view(dtype)


def row_blocks(a: np.ndarray, limit: int, scratch: Scratch | None = None):
    """The bytes of `a` in C order, a block of its rows (about `limit` bytes) at a time: a view where
    it is contiguous, else each block made contiguous in one buffer (`scratch`'s, or one of its
    own) reused from block to block (use each before taking the next). A 2-D view of a type torch
    holds (a transposed weight) is copied by torch's tiled copy: NumPy's of a 2048 x 8192 transpose
    is 6x slower."""
    if a.flags.c_contiguous or a.ndim == 0:
        yield a.reshape(-1).view(np.uint8).data
        return
    rows = max(1, limit // max(1, a[:1].nbytes))
    tiled = a.ndim == 2 and min(a.strides) >= 0 and a.dtype.kind in "fiub" and a.dtype.byteorder in "=<|"
    if not tiled:
        for start in range(0, a.shape[0], rows):
            yield np.ascontiguousarray(a[start:start + rows]).reshape(-1).view(np.uint8).data
        return
    import torch
    with warnings.catch_warnings():  # a mapped file's pages, read here and never written
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        source = torch.from_numpy(a)
    buffer = (scratch or Scratch()).take(min(rows, a.shape[0]) * a.shape[1], source.dtype)
    for start in range(0, a.shape[0], rows):
        n = min(rows, a.shape[0] - start)
        block = buffer[:n * a.shape[1]].view(n, a.shape[1])
        block.copy_(source[start:start + n])
        yield block.numpy().reshape(-1).view(np.uint8).data


# Where the model being exported keeps the weights it names as external data (a staging folder), for
# the passes that read their values (`values`); set by `external_base` while an export runs.
_BASE: contextvars.ContextVar[str] = contextvars.ContextVar("attnexport_external_base", default="")


# What `unload` wrote while an export runs (set by `external_base`): each tensor's fingerprint, taken
# from the bytes as they were written, so that `record` need not read them back.
_WRITTEN: contextvars.ContextVar[Written | None] = contextvars.ContextVar("attnexport_written", default=None)


@contextlib.contextmanager
def external_base(folder: str | Path):
    """Within the block, `values` reads an initializer held as external data from `folder`, and
    `record` knows the fingerprints of what `unload` wrote there."""
    token, written = _BASE.set(str(folder)), _WRITTEN.set(Written())
    try:
        yield
    finally:
        _WRITTEN.reset(written)
        _BASE.reset(token)


class Written:
    """The tensors `unload` wrote, each known two ways:

    - `at[(location, offset, length, header)]`: its (sha256, probe) as `_sha256_of_initializer`
      would compute them from the file, `header` being its type and shape (`_header`);
    - `source[(address, shape, strides, dtype)]`: where it lies in the file, by the memory it was
      written from (a parameter's own, or a transposed view of it).

    A parameter whose memory, as it is or transposed, is a tensor written at a place an initializer
    of the finished model still names is that initializer, with that fingerprint (`record`): the
    bytes hashed are the bytes written, read from the parameter itself. The parameters are alive
    from before the trace to the record, so no other array can have had their address.
    """

    def __init__(self):
        self.at: dict[tuple, tuple[str, tuple]] = {}
        self.source: dict[tuple, tuple] = {}
        # The memory each was written from, by its place, until the record (`transposed_external`
        # turns a tied head from there); let go then, so that the model's weights can be.
        self.arrays: dict[tuple, np.ndarray] = {}

    def add(self, raw: np.ndarray, place: tuple, digest: str, probe: tuple) -> None:
        self.at[place] = (digest, probe)
        self.source[_memory(raw)] = place
        self.arrays[place] = raw


def _memory(a: np.ndarray) -> tuple:
    """An array's identity as memory: address, shape, strides and type."""
    return a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str


def _place(init: onnx.TensorProto) -> tuple | None:
    """Where an external initializer lies (`Written.at`'s key), or None."""
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in init.external_data}
    if "location" not in info:
        return None
    dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
    return (info["location"], int(info.get("offset", 0)), int(info.get("length", nbytes(init))),
            _header(dtype, init.dims))


def values(init: onnx.TensorProto) -> np.ndarray:
    """An initializer's values, read from its external data where it is held there: mapped from
    the file (read-only, no copy) where NumPy has its type, else read (`numpy_helper.to_array`
    on a copy of the reference, which it would load the data into)."""
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
    shape = tuple(int(d) for d in init.dims)
    if dtype.kind in "fiub" and dtype.itemsize * int(np.prod(shape, dtype=np.int64)) > 0 and "location" in info:
        return np.memmap(Path(_BASE.get()) / info["location"], dtype=dtype.newbyteorder("<"), mode="r",
                         offset=int(info.get("offset", 0)), shape=shape)
    held = onnx.TensorProto()
    held.CopyFrom(init)
    return numpy_helper.to_array(held, _BASE.get())


def transposed_external(init: onnx.TensorProto, name: str, alignment: int = F.EXTERNAL_ALIGN,
                        over: bool = False) -> onnx.TensorProto | None:
    """The transpose (C, R) of a 2-D initializer (R, C) held as external data in the staging folder
    (`external_base`), written to the end of the same file (at a multiple of `alignment`) a block
    of its rows at a time and named there as the tensor `name`: neither matrix is held in memory
    whole. Where `unload` wrote `init` from memory (`Written.arrays`), it is turned from there and
    written in order, hashed as it is written (the record does not read it back), and, with `over`
    (the caller lets `init` go), written over `init`'s own bytes, which are as many: the file grows
    by nothing and keeps no hole. Else it is read back from the file. None where `init` is not held
    so."""
    info = {e.key: e.value for e in init.external_data}
    if init.data_location != onnx.TensorProto.EXTERNAL or "location" not in info or len(init.dims) != 2 \
            or not _BASE.get():
        return None
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).newbyteorder("<")
    rows, cols = (int(d) for d in init.dims)
    path = Path(_BASE.get()) / info["location"]
    written, place = _WRITTEN.get(), _place(init)
    held = written.arrays.get(place) if written is not None and place is not None else None
    if written is not None and held is not None:  # written from memory by `unload`: turned from there
        with open(path, "r+b") as dst, ThreadPoolExecutor(max_workers=1) as hasher:
            if over:
                start = dst.seek(int(info.get("offset", 0)))
            else:
                start = dst.seek(0, 2)
                dst.write(b"\0" * (-start % alignment))
                start = dst.tell()
            turned, digest, probe = _write_array(held.T, dst, Scratch(), hasher)
        place = (info["location"], start, rows * cols * dtype.itemsize, _header(turned.dtype, turned.shape))
        written.add(turned, place, digest, probe)
    else:
        step = max(1, CHUNK_BYTES // max(1, cols * dtype.itemsize))
        with open(path, "rb") as src, open(path, "r+b") as dst:
            start = dst.seek(0, 2)
            start += -start % alignment
            dst.truncate(start + rows * cols * dtype.itemsize)
            src.seek(int(info.get("offset", 0)))
            for first in range(0, rows, step):
                n = min(step, rows - first)
                block = np.frombuffer(src.read(n * cols * dtype.itemsize), dtype=dtype).reshape(n, cols)
                turned = np.ascontiguousarray(block.T)  # (cols, n): columns first..first+n of each output row
                for c in range(cols):
                    os.pwrite(dst.fileno(), turned[c].data, start + (c * rows + first) * dtype.itemsize)
    out = onnx.TensorProto(name=name, data_type=init.data_type, dims=[cols, rows],
                           data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", info["location"]), ("offset", str(start)),
                       ("length", str(rows * cols * dtype.itemsize))):
        entry = out.external_data.add()
        entry.key, entry.value = key, value
    return out


def unload(model, folder: Path, name: str, threshold: int, alignment: int, beside=None,
           early: Prewrite | None = None) -> None:
    """The weights of `model` (an onnx_ir model, whose tensors are still the module's own) written
    to `folder/name` one at a time, each of `threshold` bytes or more starting at a multiple of
    `alignment` and then named there (external data): its ONNX message is built without a copy of
    them. A NumPy-held tensor is written from its buffer (`_write_tensor`).

    `beside`: work run on a thread of its own while the weights are written (a whole model's
    float64 reference, which reads the module, not the file); its error, if any, is raised once the
    weights are written. Every tensor to write is pinned to its memory first (a torch parameter as
    its NumPy view), so the work may swap a module's parameters for float64 copies meanwhile.

    `early`: the module's matrices being written to the same file since before the trace
    (`Prewrite`): a tensor that is one of them (the same memory, shape, strides and type) is named
    where it was written, and the rest are appended after them. One written early that the graph
    does not read is a hole the staging fills or drops (`files.stage_external`)."""
    import onnx_ir as ir
    path = Path(folder) / name
    values = [v for graph in (model.graph, *model.graph.subgraphs()) for v in graph.initializers.values()
              if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor) and
              v.const_value.nbytes >= threshold]
    pinned = [_pinned(v.const_value) for v in values]
    written, scratch = _WRITTEN.get(), Scratch()
    with one_thread_each() if beside is not None else contextlib.nullcontext():
        work = _Beside(beside) if beside is not None else None
        try:
            done = early.finish() if early is not None else {}
            with open(path, "r+b" if early is not None else "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
                f.seek(0, os.SEEK_END)
                for value, raw in zip(values, pinned, strict=True):
                    tensor = value.const_value
                    hashed = done.get(_memory(raw)) if isinstance(raw, np.ndarray) else None
                    if hashed is not None:
                        offset = hashed[0]
                        hashed = hashed[1:]
                    else:
                        f.write(b"\0" * (-f.tell() % alignment))
                        offset = f.tell()
                        hashed = _write_tensor(tensor, f, scratch, hasher, raw)
                        if f.tell() - offset != tensor.nbytes:
                            raise ValueError(f"{tensor.name}: {f.tell() - offset} bytes written of {tensor.nbytes}")
                    if hashed is not None and written is not None:
                        raw, digest, probe = hashed
                        written.add(raw, (name, offset, tensor.nbytes, _header(raw.dtype, raw.shape)), digest, probe)
                    value.const_value = ir.ExternalTensor(name, offset, tensor.nbytes, tensor.dtype,
                                                          shape=tensor.shape, name=tensor.name, base_dir=str(folder))
        except OSError as e:  # a full disk: one line (the caller discards what was staged)
            size = sum(v.const_value.nbytes for v in values if not isinstance(v.const_value, ir.ExternalTensor))
            raise UsageError(f"cannot write the weights to {folder}: {e.strerror or e} (they take "
                             f"{F.human_size(size)} more)") from None
        except KeyboardInterrupt:  # Ctrl-C: the command stops now, not when the work beside ends
            work = None
            raise
        finally:
            if work is not None:  # on an error too: the work must not go on changing the caller's model
                work.join()
    if work is not None:
        work.raise_error()


# A module's matrices of this many bytes or more are written from before its trace (`Prewrite`).
EARLY_BYTES = 1 << 20


def planned(module, threshold: int = EARLY_BYTES) -> list[np.ndarray]:
    """The module's matrices as the exporter's graph will hold them, each once: a Linear's weight
    turned (MatMul reads it so), every other 2-D parameter as it is (an embedding's table, a GPT-2
    Conv1D's weight), those of `threshold` bytes or more on the CPU of a type NumPy has. A guess
    made before the trace: a matrix the graph holds another way is written again after it."""
    import torch
    seen: set[int] = set()
    out = []
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is None or id(p) in seen or p.ndim != 2 or p.device.type != "cpu" or \
                    p.numel() * p.element_size() < threshold:
                continue
            seen.add(id(p))
            with contextlib.suppress(TypeError):  # a type NumPy lacks (bfloat16)
                raw = p.detach().numpy()
                out.append(raw.T if isinstance(m, torch.nn.Linear) and n == "weight" else raw)
    return out


class Prewrite:
    """`arrays` (`planned`) written to `path` on a thread of its own, each at a multiple of
    `alignment` and hashed as it is written, while the caller traces the module: the write of a
    model's weights, most of a large export's time on a machine whose page cache fills slowly,
    starts before the trace instead of after it. `unload` names each where it was written
    (`finish`); `cancel` stops it (an export that fails before)."""

    def __init__(self, arrays: Iterable[np.ndarray], path: Path, alignment: int):
        import threading
        self.error: BaseException | None = None
        self._done: dict[tuple, tuple] = {}
        self._stop = threading.Event()

        def run():
            try:
                with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
                    scratch = Scratch()
                    for raw in arrays:
                        if self._stop.is_set():
                            return
                        f.write(b"\0" * (-f.tell() % alignment))
                        offset = f.tell()
                        self._done[_memory(raw)] = (offset, *_write_array(raw, f, scratch, hasher))
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread (`finish`)
                self.error = e
        self.thread = threading.Thread(target=run, name="attnexport-early-write", daemon=True)
        self.thread.start()

    def finish(self) -> dict[tuple, tuple]:
        """Waits for the write; {memory (`_memory`): (offset, the array, its sha256, its probe)}.
        Its error (a full disk) is raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        done, self._done = self._done, {}  # held by the caller only: the model's weights may go
        return done

    def cancel(self) -> None:
        """Stops the write after the array it is writing (the caller discards the file)."""
        self._stop.set()
        self.thread.join()


class _Beside:
    """`work()` on a thread of its own (a daemon: Ctrl-C does not wait for it), its error kept."""

    def __init__(self, work):
        import threading
        self.error: BaseException | None = None

        def run():
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                self.error = e
        self.thread = threading.Thread(target=run, name="attnexport-beside-write", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def one_thread_each():
    """torch's operators on one thread each within the block, where other work shares the cores (the
    write and its hashing, the work beside it, a forked child): on two cores a second pool of
    threads per operation spins at its barriers while the other work holds the core it waits for
    (a 1.07B model's first forward beside the write: 4.8 s against 0.8 s alone)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pinned(tensor):
    """What `_write_tensor` writes a tensor from: a torch tensor on the CPU as its NumPy view (the
    memory it holds now, whatever its module holds later), else its raw array (or None)."""
    import torch
    raw = getattr(tensor, "raw", None)
    if isinstance(raw, torch.Tensor) and raw.device.type == "cpu":
        with contextlib.suppress(TypeError):  # a type NumPy lacks (bfloat16)
            raw = raw.detach().numpy()
    return raw


# A transposed weight is made contiguous this many bytes of its rows at a time.
TRANSPOSE_BYTES = 1 << 26


def _write_tensor(tensor, f, scratch: Scratch | None = None, hasher=None, raw=None) -> tuple | None:
    """One tensor's bytes appended to `f`. A NumPy array (a parameter's view, or its transpose: the
    MatMul weights the exporter turns) is written from its buffer, a transposed one a block of rows
    at a time (`row_blocks`: NumPy's transposed copy and `tofile`, which writes in pieces, were 23 s
    of a 1.07B export's 82), each block hashed on `hasher` (an executor) while it is written:
    (the array, its `sha256_of`, its `_probe`: `_write_array`). A torch tensor (a parameter the
    graph reads as it is: an embedding's table) is written so through its NumPy view. Anything else
    is written as onnx_ir writes it (None). `raw`: the tensor as `_pinned` took it, where it was
    taken before."""
    raw = _pinned(tensor) if raw is None else raw
    if not (isinstance(raw, np.ndarray) and raw.dtype.kind in "fiub" and raw.dtype.byteorder in "=<|" and
            raw.dtype.itemsize * 8 == tensor.dtype.bitwidth):
        tensor.tofile(f)
        return None
    return _write_array(raw, f, scratch, hasher)


def _write_array(raw: np.ndarray, f, scratch: Scratch | None = None, hasher=None) -> tuple:
    """`raw`'s bytes appended to `f` a block of rows at a time (`row_blocks`), each hashed on
    `hasher` while it is written: (raw, its `sha256_of`, its `_probe`)."""
    sha, first = hashlib.sha256(_header(raw.dtype, raw.shape)), bytearray()
    for block in row_blocks(raw, TRANSPOSE_BYTES, scratch):
        if len(first) < PROBE_BYTES:
            first += block[:PROBE_BYTES - len(first)]
        hashing = hasher.submit(sha.update, block) if hasher is not None else None
        f.write(block)
        if hashing is None:
            sha.update(block)
        else:
            hashing.result()
    return raw, sha.hexdigest(), _probe(raw, bytes(first))


def total_sha256(entries: dict[str, dict]) -> str:
    """One hash over every parameter's (name, hash), in name order."""
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(f"{name}={entries[name]['sha256']};".encode())
    return h.hexdigest()


def validate(variant: schema.Variant, options: dict, params: dict) -> dict[str, np.ndarray]:
    """Checks user parameters against the module's: same names, same shapes, finite values.

    Returns them as float32 arrays; anything else is a UsageError naming the problem.
    """
    want = {k: tuple(t.shape) for k, t in variant.build(options).state_dict().items()}
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(extra)}"] if extra else [])
        raise UsageError(f"params for {variant.name}: {'; '.join(parts)} (expected {', '.join(want)})")
    out = {}
    for name, shape in want.items():
        try:
            a = np.asarray(params[name], dtype=np.float32)
        except (TypeError, ValueError):
            raise UsageError(f"params[{name!r}] is not numeric") from None
        if a.shape != shape:
            raise UsageError(f"params[{name!r}] has shape {a.shape}, the module needs {shape}")
        if not np.isfinite(a).all():
            raise UsageError(f"params[{name!r}] has {int((~np.isfinite(a)).sum())} non-finite values")
        out[name] = a
    return out


def record(model: onnx.ModelProto, params: Mapping[str, np.ndarray], np_dtype) -> dict[str, dict]:
    """Finds every parameter among the model's initializers; returns its metadata entry.

    A parameter held transposed as a block of columns of a wider initializer (projections packed
    into one MatMul) is recorded with those columns (`columns: [start, stop]`) and the hash of the
    block. A parameter the exporter did not keep as one initializer (folded into another constant)
    is recorded with layout "folded" and the hash of its own value: it is fingerprinted, but
    `read` cannot check it in the file. A tensor the trace wrote (`unload`, within `external_base`)
    is not read back: its fingerprint was taken as it was written, and a parameter whose memory it
    was written from is matched to it without hashing (`Written`). Anything else is hashed once, in
    chunks (an initializer held as external data read from its file, never mapped whole; a
    parameter in place, a transposed one a block of rows at a time), on a thread per core (hashlib
    lets go of the interpreter's lock): no weight of a whole model is held twice.
    """
    import threading

    inits = list(model.graph.initializer)
    # What `unload` hashed as it wrote it, at the places the finished model still names.
    written = _WRITTEN.get() or Written()
    written.arrays.clear()  # nothing turns a written tensor after this: the weights may go
    named = {place: init.name for init in inits if (place := _place(init)) in written.at}
    scratches = threading.local()  # a `Scratch` per thread of the pool
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        # Initializers by their sha256 (of type, shape and bytes, `sha256_of`): a parameter is looked
        # up by its own, not compared with every initializer of its shape (a model of thirty like
        # layers has thirty of each).
        index: dict[str, str] = {}
        # Each initializer's type, shape and first bytes (`_probe`): a parameter is hashed whole only in
        # the layout whose first bytes some initializer has (a square matrix, or an MLP's up and down
        # projections, match another initializer's shape as-is: each was hashed twice, 6 s of 8 at 1B).
        probes: set = set()
        base = _BASE.get()  # a context variable: the pool's threads have contexts of their own

        def fingerprint(init):
            place = _place(init)
            return written.at[place] if place in named else _sha256_of_initializer(init, base)

        for init, (digest, probe) in zip(inits, pool.map(fingerprint, inits), strict=True):
            index.setdefault(digest, init.name)
            probes.add(probe)

        def find(name: str):
            p = np.asarray(params[name]).astype(np_dtype, copy=False)
            layouts = (("as-is", p), ("transposed", p.T if p.ndim == 2 else None))
            for layout, a in layouts:  # the memory written from
                place = written.source.get(_memory(a)) if a is not None else None
                if place in named:
                    return name, (named[place], layout, written.at[place][0])
            for layout, a in layouts:
                if a is not None and _probe(a) in probes:
                    if not hasattr(scratches, "one"):
                        scratches.one = Scratch()
                    digest = sha256_of(a, scratches.one)
                    if digest in index:
                        return name, (index[digest], layout, digest)
            return name, None

        found = dict(pool.map(find, sorted(params)))
    entries = {}
    for name in sorted(params):
        if found[name] is not None:
            iname, layout, digest = found[name]
            entries[name] = {"initializer": iname, "layout": layout, "sha256": digest}
            continue
        p = np.asarray(params[name]).astype(np_dtype, copy=False)
        block = _columns_of(inits, p.T) if p.ndim == 2 else None
        if block is not None:
            iname, start, arr = block
            entries[name] = {"initializer": iname, "layout": "transposed", "columns": [start, start + p.shape[0]],
                             "sha256": sha256_of(arr[:, start:start + p.shape[0]])}
        else:
            entries[name] = {"initializer": None, "layout": "folded", "sha256": sha256_of(p)}
    return entries


# What is read of an initializer's file at a time (and of a transposed array, in rows) to hash it.
CHUNK_BYTES = 1 << 24


# An array's first bytes that `_probe` reads.
PROBE_BYTES = 4096


def _probe(a: np.ndarray, first: bytes | None = None) -> tuple:
    """(type, shape, sha256 of the first PROBE_BYTES bytes in C order): what a parameter's layout must
    share with an initializer before either is hashed whole. `first`: those bytes, already read."""
    if first is None:
        rows = a if a.ndim == 0 else a[:max(1, -(-PROBE_BYTES // max(1, a[:1].nbytes)))]
        first = np.ascontiguousarray(rows).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()[:PROBE_BYTES]
    return _dtype_str(a.dtype), tuple(int(d) for d in a.shape), hashlib.sha256(first[:PROBE_BYTES]).hexdigest()


def _sha256_of_initializer(init: onnx.TensorProto, base: str) -> tuple[str, tuple]:
    """(`sha256_of` an initializer's values, its `_probe`): read from its external file (in the folder
    `base`) CHUNK_BYTES at a time (a whole model's weights are not mapped into the resident set),
    else from the message."""
    info = {e.key: e.value for e in init.external_data}
    if init.data_location != onnx.TensorProto.EXTERNAL or "location" not in info:
        a = values(init)
        return sha256_of(a), _probe(a)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
    shape = tuple(int(d) for d in init.dims)
    sha = hashlib.sha256(_header(dtype, shape))
    left = nbytes(init)
    first = None
    with open(Path(base) / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        while left > 0:
            chunk = f.read(min(left, CHUNK_BYTES))
            if not chunk:
                raise ValueError(f"{init.name}: its external data ends {left} bytes early")
            if first is None:
                first = chunk[:PROBE_BYTES]
            sha.update(chunk)
            left -= len(chunk)
    return sha.hexdigest(), (_dtype_str(dtype), shape, hashlib.sha256(first or b"").hexdigest())


def _dtype_str(dtype) -> str:
    return np.dtype(dtype).newbyteorder("<").str


# Initializers of this many bytes and more are left out of `skeleton` (graph inputs there).
SKELETON_BYTES = 1 << 16


def skeleton(model: onnx.ModelProto, threshold: int = SKELETON_BYTES) -> onnx.ModelProto:
    """The model with each floating-point initializer of `threshold` bytes or more made a graph
    input of its type and shape, nothing of its data copied: what onnx's checker and shape
    inference read of a whole model without holding its weights twice (the small and integer
    initializers, which shape computations read, stay; one held as external data goes too: the
    checker would look for its file from the working folder)."""
    graph = model.graph
    big = {i.name for i in graph.initializer if (i.data_type in _FLOAT_TYPES and nbytes(i) >= threshold)
           or i.data_location == onnx.TensorProto.EXTERNAL}
    out = onnx.ModelProto()
    for f, value in model.ListFields():
        if f.name != "graph":
            _copy_field(out, f, value)
    for f, value in graph.ListFields():
        if f.name != "initializer":
            _copy_field(out.graph, f, value)
    out.graph.initializer.extend(i for i in graph.initializer if i.name not in big)
    out.graph.input.extend(onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                           for i in graph.initializer if i.name in big)
    return out


def _copy_field(message, f, value) -> None:
    repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED  # protobuf < 6: label
    if repeated:
        getattr(message, f.name).extend(value)
    elif f.message_type is not None:
        getattr(message, f.name).CopyFrom(value)
    else:
        setattr(message, f.name, value)


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE)


def nbytes(init: onnx.TensorProto) -> int:
    """The bytes of an initializer's values, from its type and shape (its data may be held elsewhere)."""
    n = int(np.prod(init.dims, dtype=np.int64)) if init.dims else 1
    return n * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize


def _bytes_of(a: np.ndarray):
    """A contiguous array's bytes as they lie (a view, not a copy of a whole model's weights)."""
    return a.reshape(-1).view(np.uint8).data if a.size else b""


def _columns_of(inits, block: np.ndarray):
    """(initializer name, first column, its array) of a 2-D initializer holding `block` as a run of
    its columns, or None."""
    rows, width = block.shape
    for init in inits:
        if len(init.dims) != 2 or init.dims[0] != rows or init.dims[1] <= width:
            continue
        iname, arr = init.name, values(init)
        if arr.dtype != block.dtype:
            continue
        for start in np.flatnonzero((arr == block[:, :1]).all(axis=0)):
            if start + width <= arr.shape[1] and np.array_equal(arr[:, start:start + width], block):
                return iname, int(start), arr
    return None


def read(model: onnx.ModelProto, entries: dict[str, dict], base_dir: str = "",
         keep: bool = True) -> tuple[dict[str, np.ndarray], list[str]]:
    """The model's own parameters (float32, in the module's layout) and the names whose hash changed.

    A parameter whose initializer is gone counts as changed. An initializer held as external data
    is read from beside the model (`base_dir`, the model file's folder), one at a time; `keep=False`
    checks the hashes alone (the parameters are not gathered: a whole model is not copied).
    """
    inits = {i.name: i for i in model.graph.initializer}
    params, changed = {}, []
    for name, e in sorted(entries.items()):
        if e["layout"] == "folded" or "quantized" in e:  # a quantized one: attnexport.pretrained.precision checks it
            continue
        init = inits.get(e["initializer"])
        if init is None:
            changed.append(name)
            continue
        arr = numpy_helper.to_array(init, base_dir)
        if "columns" in e:
            arr = np.ascontiguousarray(arr[:, e["columns"][0]:e["columns"][1]])
        if sha256_of(arr) != e["sha256"]:
            changed.append(name)
        if keep:
            value = arr.T if e["layout"] == "transposed" else arr
            params[name] = np.ascontiguousarray(value).astype(np.float32)
    return params, changed


def reweight(model: onnx.ModelProto, entries: dict[str, dict], params: dict[str, np.ndarray]) -> onnx.ModelProto | None:
    """A copy of `model` holding `params` in place of the parameters `entries` records.

    The graph of an export does not depend on its parameters' values, so one export serves any
    parameters of the same shapes: the initializers are replaced (in their recorded layout and
    dtype) and the fingerprints recomputed. None when that is not possible (a folded parameter,
    one initializer shared by two parameters, another parameter set).
    """
    if set(entries) != set(params):
        return None
    holders = [e["initializer"] for e in entries.values()]
    if any(e["layout"] not in LAYOUTS or "columns" in e or "quantized" in e for e in entries.values()) or \
            len(set(holders)) != len(holders):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {i.name: i for i in out.graph.initializer}
    new = {}
    for name, e in entries.items():
        init = inits.get(e["initializer"])
        if init is None:
            return None
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        value = np.asarray(params[name], dtype=np.float32)
        value = np.ascontiguousarray(value.T if e["layout"] == "transposed" else value).astype(dtype)
        if tuple(init.dims) != value.shape:
            return None
        init.CopyFrom(numpy_helper.from_array(value, init.name))
        new[name] = {**e, "sha256": sha256_of(value)}
    record = ExportRecord.of(out)
    replace(record, params=as_json(new), params_sha256=total_sha256(new), params_source="given").write(out)
    return out
