"""`ort-node`, `ort-wasm`, `ort-webgpu`: ONNX Runtime where apps deploy it.

`ort-node` is onnxruntime-node in a Node process; `ort-wasm` and `ort-webgpu` are onnxruntime-web's
WASM and WebGPU backends in headless Chromium (the machine's GPU where it has one, the software
adapter otherwise; the runtime's description names the adapter that ran). One JavaScript process
(`js/bridge.mjs`) serves the three: Python starts it on first use and talks to it over a pipe
(frames of JSON, each with a binary part: a model's bytes or the tensors'). A run's outputs stay in the
JavaScript process until its next run, and an input that is one of them (a cache fed back, the
same array object) is named instead of sent: a static cache of hundreds of MB a step crosses the
pipe once a step, not twice, and without base64. The page is served from 127.0.0.1 only.

The npm packages are pinned (`js/package.json`, `js/package-lock.json`) and installed by attnexport
into its cache folder on first use (`attnexport runtimes --install` does it ahead, as CI does);
`ATTNEXPORT_JS_HOME` moves that folder, `ATTNEXPORT_JS_INSTALL=0` forbids installing (the test
suite sets it: it writes nothing outside its temporary folders), `ATTNEXPORT_CHROMIUM` names the
browser. What is missing is said in one line with its fix.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import onnx

from attnexport import files as F
from attnexport import weights as W
from attnexport.errors import ProviderUnavailableError, UsageError
from attnexport.runtimes import base as R

PACKAGE = Path(__file__).parent / "js"
NODE_MIN = 20  # playwright-core 1.65 needs Node 20
REQUEST_SECONDS = 900  # a request that takes longer (a hung browser) ends the process
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_DTYPES: dict[np.dtype, str] = {np.dtype(t): name for t, name in (
    (np.float32, "float32"), (np.float16, "float16"), (np.int64, "int64"), (np.int32, "int32"), (np.bool_, "bool"),
    (np.uint8, "uint8"), (np.int8, "int8"), (np.float64, "float64"))}
_NUMPY: dict[str, np.dtype] = {name: dtype for dtype, name in _DTYPES.items()}


def pins() -> dict[str, str]:
    """The npm packages and their exact versions."""
    return json.loads((PACKAGE / "package.json").read_text())["dependencies"]


def home() -> Path:
    """Where the pinned packages are installed: `ATTNEXPORT_JS_HOME`, else a folder named after the
    lockfile in attnexport's cache folder (a new pin installs beside the old)."""
    env = os.environ.get("ATTNEXPORT_JS_HOME")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    lock = hashlib.sha256((PACKAGE / "package-lock.json").read_bytes()).hexdigest()[:12]
    return Path(base) / "attnexport" / f"js-{lock}"


def installed(where: Path | None = None) -> bool:
    where = home() if where is None else where
    for name, version in pins().items():
        try:
            if json.loads((where / "node_modules" / name / "package.json").read_text())["version"] != version:
                return False
        except (OSError, ValueError, KeyError):
            return False
    return True


@functools.cache
def find_node() -> tuple[str | None, str]:
    """(the node executable, its version) or (None, why not)."""
    node = shutil.which("node")
    if node is None:
        return None, "no Node.js (`node`) on the PATH: install Node.js 20 or newer (nodejs.org, or the system's nodejs)"
    try:
        version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        major = int(version.lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return None, f"{node} --version did not answer"
    if major < NODE_MIN:
        return None, f"Node.js {version} is too old: install Node.js {NODE_MIN} or newer"
    return node, version


@functools.cache
def find_chromium() -> tuple[str | None, str]:
    """(the browser executable, its version) or (None, why not)."""
    given = os.environ.get("ATTNEXPORT_CHROMIUM")
    if given and not (os.path.isfile(given) and os.access(given, os.X_OK)):
        return None, f"ATTNEXPORT_CHROMIUM={given} is not an executable file"
    found = given or next((p for p in map(shutil.which, _BROWSERS) if p), None)
    if found is None:
        return None, ("no Chromium: install it (`apt-get install chromium` on Debian and Ubuntu) or set "
                      "ATTNEXPORT_CHROMIUM to a Chromium or Chrome executable")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return found, out.splitlines()[-1] if out else found


def _may_install() -> bool:
    return os.environ.get("ATTNEXPORT_JS_INSTALL", "1").strip().lower() not in ("0", "no", "off", "false")


def packages() -> tuple[bool, str]:
    """(whether the pinned npm packages are installed or can be on first use, why not): installing
    needs npm, and is off with ATTNEXPORT_JS_INSTALL=0."""
    if installed():
        return True, ""
    if not _may_install():
        return False, f"the npm packages are not installed in {home()}: run `attnexport runtimes --install`"
    if shutil.which("npm") is None:
        return False, "no npm on the PATH to install onnxruntime-node/-web (it comes with Node.js)"
    return True, ""


def status(name: str) -> R.Status:
    node, why = find_node()
    if node is None:
        return R.Status(name, False, why)
    browser = None
    if name != "ort-node":
        browser, version = find_chromium()
        if browser is None:
            return R.Status(name, False, version)
    ok, missing = packages()
    if not ok:
        return R.Status(name, False, missing)
    pinned = pins()
    if name == "ort-node":
        return R.Status(name, True, f"onnxruntime-node {pinned['onnxruntime-node']}, Node {why}")
    where = f"onnxruntime-web {pinned['onnxruntime-web']} ({name[4:]}), {version}"
    warning = ""
    if name == "ort-webgpu" and _BRIDGE is not None and _BRIDGE.adapter is not None:
        where += f", adapter: {describe_adapter(_BRIDGE.adapter)}"
        warning = (_BRIDGE.float16 or "") if _BRIDGE.float16_loaded else ""
    return R.Status(name, True, where, warning)


def describe_adapter(adapter: dict) -> str:
    if not adapter.get("available"):
        return f"none ({adapter.get('reason', '')})"
    words = " ".join(w for w in (adapter.get("vendor"), adapter.get("architecture"), adapter.get("description")) if w)
    return f"{words or 'unnamed'}" + (" (a software fallback adapter, not a GPU)" if adapter.get("fallback") else "")


def install(progress=sys.stderr) -> Path:
    """Installs the pinned npm packages (once; a folder is renamed into place only when complete)."""
    target = home()
    if installed(target):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise ProviderUnavailableError("no npm on the PATH to install onnxruntime-node/-web (it comes with Node.js)")
    listed = ", ".join(f"{n} {v}" for n, v in pins().items())
    print(f"attnexport: installing {listed} into {target} (about 450 MB, once)", file=progress, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for f in ("package.json", "package-lock.json"):
            shutil.copyfile(PACKAGE / f, work / f)
        env = {**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"}  # the CPU build only: no CUDA binaries fetched
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()
            raise ProviderUnavailableError(f"npm could not install {listed}: {last[-1] if last else r.returncode}")
        if installed(target):  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


class _Bridge:
    """The JavaScript process and its pipe; one request at a time."""

    def __init__(self):
        node, _ = find_node()
        if node is None:
            raise ProviderUnavailableError(find_node()[1])
        if not installed():
            if not _may_install():
                raise ProviderUnavailableError(f"the npm packages are not installed in {home()}: run "
                                               "`attnexport runtimes --install`")
            install()
        env = {**os.environ, "ATTNEXPORT_JS_HOME": str(home())}
        browser, _ = find_chromium()
        if browser:
            env["ATTNEXPORT_CHROMIUM"] = browser
        self.log = tempfile.TemporaryFile()  # the process's own messages: read when it fails
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([node, str(PACKAGE / "bridge.mjs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)
        self.lock = threading.RLock()
        self.released: list[int] = []
        self.adapter: dict | None = None
        self.float16: str | None = None  # `float16_wrong`'s answer: None before it is asked
        self.float16_loaded = False  # a float16 model loaded since the last report said so (`warning_said`)
        self.call({"op": "hello"})
        self.startup_ms = {"ort-node": (time.perf_counter() - t0) * 1e3}

    def call(self, request: dict, binary: bytes | list = b"") -> dict:
        """One request and its answer; `binary` travels beside the JSON (a model's bytes, or the
        tensors' as a list of parts); the answer's own binary part is its `"binary"`."""
        with self.lock:
            while self.released and request.get("op") != "release":
                self._exchange({"op": "release", "id": self.released.pop()})
            answer = self._exchange(request, binary)
        if "error" in answer:
            raise RuntimeError(answer["error"] + (f" (browser: {answer['log']})" if answer.get("log") else ""))
        return answer

    def _exchange(self, request: dict, binary: bytes | list = b"") -> dict:
        body = json.dumps(request).encode()
        parts = binary if isinstance(binary, list) else [binary]
        timer = threading.Timer(REQUEST_SECONDS, self.proc.kill)
        timer.start()
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(struct.pack("<I", len(body)) + body + struct.pack("<I", sum(len(p) for p in parts)))
            for part in parts:
                self.proc.stdin.write(part)
            self.proc.stdin.flush()
            (n,) = struct.unpack("<I", self._read(4))
            answer = json.loads(self._read(n))
            (m,) = struct.unpack("<I", self._read(4))
            answer["binary"] = self._read(m)
            return answer
        except BrokenPipeError:
            raise RuntimeError(f"the JavaScript runtime process ended: {self._last_words()}") from None
        finally:
            timer.cancel()

    def _read(self, n: int) -> bytearray:
        """Exactly `n` bytes of the answer (writable: the arrays made on them are the caller's)."""
        assert self.proc.stdout is not None
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            k = self.proc.stdout.readinto(view[got:])
            if not k:
                raise RuntimeError(f"the JavaScript runtime process ended: {self._last_words()}")
            got += k
        return out

    def _last_words(self) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else f"exit status {self.proc.poll()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                body = json.dumps({"op": "quit"}).encode()
                self.proc.stdin.write(struct.pack("<I", len(body)) + body + struct.pack("<I", 0))
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


_BRIDGE: _Bridge | None = None


def bridge() -> _Bridge:
    """The run's JavaScript process, started on first use."""
    global _BRIDGE
    if _BRIDGE is None or _BRIDGE.proc.poll() is not None:
        _BRIDGE = _Bridge()
        atexit.register(_BRIDGE.close)
    return _BRIDGE


def release_idle() -> None:
    """Releases now, in the JavaScript process, the sessions nothing here can run any more (they are
    otherwise released before its next request): their models' memory back, in Node and in the
    browser, between runs that hold large models. Nothing when no JavaScript process runs."""
    if _BRIDGE is not None and _BRIDGE.proc.poll() is None:
        with _BRIDGE.lock:
            while _BRIDGE.released:
                _BRIDGE._exchange({"op": "release", "id": _BRIDGE.released.pop()})


def _tensors(feed: dict, last: dict) -> tuple[dict, list]:
    """The request's feeds and its binary parts: each array's bytes, or a reference to the
    session's last output when the array is that output itself (fed back unchanged: the arrays a run
    returns are read-only, so one that was written to is a copy and travels)."""
    feeds, parts, offset = {}, [], 0
    for name, a in feed.items():
        kept = next((out for out, arr in last.items() if arr is a), None)
        if kept is not None:
            feeds[name] = {"ref": kept}
            continue
        a = np.ascontiguousarray(a)
        if a.dtype not in _DTYPES:
            raise ValueError(f"a {a.dtype} input cannot go to ONNX Runtime in JavaScript")
        data = a.tobytes()
        feeds[name] = {"dtype": _DTYPES[a.dtype], "dims": list(a.shape), "offset": offset, "nbytes": len(data)}
        parts.append(data)
        offset += len(data)
    return feeds, parts


def _array(t: dict, binary: bytearray) -> np.ndarray:
    a = np.frombuffer(binary, dtype=_NUMPY[t["dtype"]], count=t["nbytes"] // _NUMPY[t["dtype"]].itemsize,
                      offset=t["offset"]).reshape(t["dims"])
    a.flags.writeable = False  # fed back as it is, it is named, not sent (`_tensors`)
    return a


# What the JavaScript runtimes are given in one message at most (protobuf's limit, WebAssembly's 2 GB).
JS_LIMIT = (1 << 31) - 1


def refuse_too_large(name: str, model: onnx.ModelProto) -> None:
    """A UsageError in one line where `model`'s weights are more than `name` is given in one message
    (JS_LIMIT); its initializers' sizes are read from their shapes, so the model may be one read
    without its external data."""
    size = sum(W.nbytes(i) for i in model.graph.initializer)
    if size > JS_LIMIT:
        held = "WebAssembly's memory and ONNX Runtime Web's model buffer hold" if name != "ort-node" else \
            "attnexport gives onnxruntime-node the model as one protobuf message, which holds"
        raise UsageError(f"runtime {name} cannot load a model of {F.human_size(size)} of weights: {held} 2 GB at "
                         "most; verify it on ort-cpu or ort-cuda")


def prepare(name: str, model: onnx.ModelProto, optimize: bool = True, threads: int | None = None,
            prepack: bool = True) -> R.Prepared:
    """`model` on `name` (ort-node, ort-wasm or ort-webgpu), run by output name; a model above
    what the runtime is given in one message (JS_LIMIT) is a UsageError in one line."""
    refuse_too_large(name, model)
    b = bridge()
    request = {"op": "load", "runtime": name, "optimize": optimize, "threads": threads or R.cpu_threads() or 0}
    if name == "ort-node" and R.has_fp16(model):
        # The CPU provider's NCHWc pass crashes on fp16 Transpose -> MatMul (see runtimes.ort); the
        # JavaScript API cannot leave one pass out, so the layout level is not run.
        request["level"] = "extended"
    started = time.perf_counter()
    first_browser = name != "ort-node" and b.adapter is None and not any(k != "ort-node" for k in b.startup_ms)
    try:
        info = b.call(request, model.SerializeToString())
    except RuntimeError as e:
        if "no WebGPU adapter" in str(e):
            raise ProviderUnavailableError(f"runtime ort-webgpu is not available: {e}") from None
        raise
    if first_browser:
        b.startup_ms["browser"] = (time.perf_counter() - started) * 1e3
    if info.get("adapter"):
        b.adapter = info["adapter"]
    session = _Session(info["id"])
    weakref.finalize(session, b.released.append, session.id)  # released before the next request
    outputs = list(info["outputs"])

    last: dict = {}  # the last run's outputs, which the JavaScript process keeps

    def run(feed: dict) -> dict:  # holds the session as long as it can be called
        feeds, parts = _tensors(feed, last)
        answer = b.call({"op": "run", "id": session.id, "feeds": feeds}, parts)
        last.clear()
        last.update({n: _array(answer["outputs"][n], answer["binary"]) for n in outputs})
        return dict(last)

    def time_runs(feed: dict, runs: int) -> list[float]:
        feeds, parts = _tensors(feed, last)
        return list(b.call({"op": "time", "id": session.id, "feeds": feeds, "runs": runs}, parts)["ms"])

    placement = {provider: list(nodes) for provider, nodes in (info.get("placement") or {}).items()}
    shapes = R.shape_computations(model) if name == "ort-webgpu" else frozenset()
    note = f"adapter: {describe_adapter(b.adapter)}" if name == "ort-webgpu" and b.adapter else ""
    if name == "ort-webgpu" and R.has_fp16(model) and (wrong := float16_wrong(b)):
        note += f"; {wrong}"
        b.float16_loaded = True
    if name == "ort-wasm":  # the browser gives WASM threads only to a cross-origin isolated page
        note = f"{info.get('threads') or 1} WASM thread(s)" + ("" if info.get("isolated") else ", page not isolated")
    return R.Prepared(name, run, sorted(placement) or [name], placement, shapes, note=note, time_runs=time_runs)


def warning_said(name: str) -> None:
    """A report has said `status(name).warning`: the next says it again only for a float16 model it loads."""
    if _BRIDGE is not None:
        _BRIDGE.float16_loaded = False


def float16_wrong(b: _Bridge) -> str:
    """Whether the browser's WebGPU adapter computes float16 wrong, asked once a bridge (the first
    time a float16 model is loaded there): an Add of two small float16 arrays, against NumPy. Chromium's
    software adapter (SwiftShader) gets every float16 op but a copy wrong (tests/test_js_runtimes.py),
    so a float16 model's rows there fail for the adapter, not for the model: that is said, in a line,
    beside the runtime. "" where it is right."""
    if b.float16 is not None:
        return b.float16
    b.float16 = ""  # the probe is a float16 model itself
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "float16",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [4, 64]) for n in ("a", "b")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 64])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.linspace(-4, 4, 256, dtype=np.float16).reshape(4, 64)
    y = np.linspace(3, -1, 256, dtype=np.float16).reshape(4, 64)
    try:
        got = prepare("ort-webgpu", probe).run({"a": x, "b": y})["y"].astype(np.float64)
    except Exception as e:  # noqa: BLE001 - the user's model loaded; the probe's failure is said, not raised
        b.float16 = f"whether this adapter computes float16 right is not known (its probe failed: {str(e)[:200]})"
        return b.float16
    err = float(np.abs(got - (x.astype(np.float64) + y)).max())
    if not err <= 2.0**-10 * 8:  # eight half-steps of fp16 below 8 (the sums' magnitudes); NaN too
        b.float16 = (f"this adapter computes float16 wrong (an Add of two float16 arrays off by {err:.3g}): a float16 "
                     "model's answers on it are the adapter's, not the model's; a GPU adapter is needed to judge them")
    return b.float16


class _Session:
    """A session in the JavaScript process, released there when nothing here can run it any more."""

    def __init__(self, id_: int):
        self.id = id_
