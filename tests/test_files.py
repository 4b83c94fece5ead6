"""Never harm what the user has: checked targets, atomic writes, the umask, one-line errors, Ctrl-C."""

import os
import stat

import pytest
from conftest import cli as run

from attnexport import export as E
from attnexport import files as F
from attnexport import golden
from attnexport.errors import UsageError


def one_line_error(r, code=2, text=""):
    assert r.exit_code == code, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], r.output


def test_device_and_fifo_are_refused_and_untouched(tmp_path):
    one_line_error(run("export", "--variant", "posenc", "-o", "/dev/null"), text="it is a device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    one_line_error(run("export", "--variant", "posenc", "-o", fifo), text="it is a FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    one_line_error(run("bench", "--variant", "posenc", "--plot", "/dev/null"), text="it is a device")


def test_symlink_is_written_through_and_kept(tmp_path):
    target = tmp_path / "real.onnx"
    link = tmp_path / "link.onnx"
    link.symlink_to(target.name)
    assert run("export", "--variant", "posenc", "-o", link).exit_code == 0
    assert link.is_symlink() and os.readlink(link) == "real.onnx"
    assert target.read_bytes()[:2] and target.is_file()


def test_new_files_get_the_umask_mode_and_replaced_ones_keep_theirs(tmp_path):
    old = os.umask(0o022)
    try:
        path = F.atomic_write(tmp_path / "a.bin", b"x")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.chmod(path, 0o600)
        F.atomic_write(path, b"y")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"y"
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".attnexport-*"))


def test_a_write_never_changes_the_umask_and_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    """The mode comes from os.open(..., 0o666) under the umask, not from changing the process's umask
    for a moment (another thread could make a file then); the data is fsynced before the rename."""
    events = []

    def no_umask(mask):
        raise AssertionError("os.umask called")
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "umask", no_umask)
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    path = F.atomic_write(tmp_path / "a.bin", b"data")
    assert path.read_bytes() == b"data"
    assert events[:2] == ["fsync", "replace"]


def test_long_file_name_is_written(tmp_path):
    name = "m" * 245 + ".onnx"  # 250 bytes: valid, but a temporary name derived from it would not be
    r = run("export", "--variant", "posenc", "-o", tmp_path / name)
    assert r.exit_code == 0, r.output
    assert (tmp_path / name).exists() and not list(tmp_path.glob(".attnexport-*"))
    with pytest.raises(UsageError, match="longer than 255"):
        F.resolve_target(tmp_path / ("m" * 256))


def test_unwritable_folders_are_refused_before_any_work(tmp_path):
    one_line_error(run("bench", "--variant", "mha", "--plot", "/proc/lat.png"), text="cannot write /proc/lat.png")
    afile = tmp_path / "file"
    afile.write_text("x")
    one_line_error(run("bench", "--variant", "mha", "--plot", afile / "lat.png"), text="is not a folder")
    one_line_error(run("export", "--variant", "posenc", "-o", tmp_path), text="it is a folder")
    one_line_error(run("golden", "--write", "--dir", "/proc/golden"), text="cannot write golden cases")
    one_line_error(run("verify", "--variant", "posenc", "--runtimes", "ort-cpu", "--save-baseline", afile),
                   text="is not a folder")


@pytest.mark.parametrize("args, text", [
    (["export", "--variant", "mha", "--batch", "100000", "--seq", "100000"], "GiB; this machine has"),
    (["export", "--variant", "mha", "--dim", "100000", "--heads", "1"], "GiB; this machine has"),
    (["bench", "--variant", "mha", "--batch", "100000", "--seq", "100000"], "GiB; this machine has"),
    (["bench", "--variant", "mha", "--threads", "-1"], "'--threads': -1 is not in the range x>=1"),
    (["golden", "--check", "--write"], "exclude each other"),
    (["export", "--variant", "sdpa", "--heads", "3"], None),  # --kv-heads follows --heads
    (["export", "--variant", "sdpa", "--softcap", "inf"], "--softcap must be a finite number in [0, 10000]"),
    (["export", "--variant", "sdpa", "--scale", "inf"], "--scale must be a finite number in [0, 1000]"),
    (["export", "--variant", "sdpa", "--scale", "1e39"], "got 1e+39"),
    (["export", "--variant", "sdpa", "--scale", "nan"], "--scale must be a finite number"),
    (["export", "--variant", "mha", "--scaling", "cosine", "--temperature", "1e-40"], "[0.001, 1000]"),
    (["export", "--variant", "mha", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range"),
    (["bench", "--variant", "mha", "--seed", "-1"], "Invalid value for '--seed'"),
    (["verify", "x.onnx", "--variant", "mha", "--seed", "-1"], "Invalid value for '--seed'"),
    (["verify", "--runtimes", ""], "names no runtime; valid: torch, torch-cuda"),
    (["verify", "--runtimes", "ort-cpux"], "unknown runtime 'ort-cpux' (did you mean ort-cpu?)"),
    (["export", "--variant", "mha", "--bogus"], "--bogus"),  # click's words: "No such option '--bogus'." (8.2)
    (["export", "--variant", "mha", "--dim", "abc"], "'abc' is not a valid integer"),
    (["export", "--variant", "posenc", "-o", "/proc/version"], "the folder /proc does not take new files"),
    (["export", "--variant", "posenc", "-o", "no/such/folder/m.onnx"], "its folder no/such/folder does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args, text):
    r = run(*args)
    if text is None:  # valid after all: --kv-heads follows --heads, into the default models/sdpa.onnx
        import json

        import onnx
        assert r.exit_code == 0 and r.output.startswith("models/sdpa.onnx: sdpa"), r.output
        meta = {p.key: p.value for p in onnx.load("models/sdpa.onnx").metadata_props}
        options = json.loads(meta["attnexport.options"])
        assert (options["heads"], options["kv_heads"]) == (3, 3)
        return
    one_line_error(r, text=text)


def test_a_dangling_link_is_refused_and_nothing_is_made(tmp_path):
    """A link whose target's folder does not exist: exit 2, and no folder is created for it."""
    link = tmp_path / "d.onnx"
    link.symlink_to(tmp_path / "missing" / "dir" / "x.onnx")
    one_line_error(run("export", "--variant", "posenc", "-o", link), text="(" + str(link) + " is a link to")
    assert not (tmp_path / "missing").exists() and link.is_symlink()


def test_the_default_output_folder_is_made_in_the_working_folder():
    from pathlib import Path
    r = run("export", "--variant", "posenc")
    assert r.exit_code == 0, r.output
    assert Path("models/posenc.onnx").is_file()  # in the test's own temporary working folder


def test_metadata_is_strict_json(tmp_path):
    """Options are finite, so the metadata parses without JSON's non-standard Infinity/NaN."""
    import json

    import onnx

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    path = tmp_path / "s.onnx"
    assert run("export", "--variant", "sdpa", "--softcap", "50", "--scale", "0.5", "-o", path).exit_code == 0
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    for key in ("attnexport.options", "attnexport.params"):
        json.loads(meta[key], parse_constant=refuse)


def test_golden_write_refuses_the_installed_copy(monkeypatch):
    monkeypatch.setattr(golden, "default_dir_is_installed", lambda: True)
    one_line_error(run("golden", "--write"), text="give --dir")


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(E, "build_model", interrupted)
    r = run("export", "--variant", "posenc", "-o", tmp_path / "x.onnx")
    one_line_error(r, code=130, text="interrupted")
    assert list(tmp_path.iterdir()) == []


def test_the_checkout_check_sees_added_changed_and_removed_files(tmp_path):
    """conftest's end-of-run check: what it compares sees every kind of change, and ignores the
    folders it may (git's, virtual environments, bytecode caches)."""
    import time

    from conftest import checkout_state
    (tmp_path / "models").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    before = checkout_state(tmp_path)
    (tmp_path / "models" / "new.onnx").write_text("x")
    time.sleep(0.01)
    (tmp_path / "a.txt").write_text("changed")
    (tmp_path / "b.txt").unlink()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.pyc").write_text("ignored")
    after = checkout_state(tmp_path)
    assert sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p)) == \
        ["a.txt", "b.txt", "models/new.onnx"]


def _weights_model(n=3, size=5000):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper
    inits = [numpy_helper.from_array(np.full(size, i + 0.5, np.float32), f"w{i}") for i in range(n)]
    inits.append(numpy_helper.from_array(np.zeros(2, np.float32), "small"))
    nodes = [helper.make_node("Add", ["x", f"w{i}"], [f"y{i}"]) for i in range(n)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [size])],
                              [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, [size])
                               for i in range(n)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_a_graph_staged_with_external_data_is_committed_beside_its_data_each_tensor_aligned(tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort
    target = tmp_path / "m.onnx"
    old = os.umask(0o027)
    try:
        staged = F.stage_external(_weights_model(), target)
    finally:
        os.umask(old)
    assert not target.exists() and staged.graph.is_file() and staged.data.is_file()
    session = ort.InferenceSession(str(staged.graph), providers=["CPUExecutionProvider"])  # the check loads this
    assert session.run(["y2"], {"x": np.zeros(5000, np.float32)})[0][0] == 2.5
    del session
    assert staged.commit() == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx_data"]
    assert all(p.stat().st_mode & 0o027 == 0 for p in tmp_path.iterdir())
    model = onnx.load(target, load_external_data=False)
    offsets = [int({e.key: e.value for e in i.external_data}["offset"]) for i in model.graph.initializer
               if i.data_location == onnx.TensorProto.EXTERNAL]
    assert len(offsets) == 3 and all(o % F.EXTERNAL_ALIGN == 0 for o in offsets)
    loaded = onnx.load(target)  # the small tensor stayed in the graph
    assert [float(onnx.numpy_helper.to_array(i)[0]) for i in loaded.graph.initializer] == [0.5, 1.5, 2.5, 0.0]


def _scratch_model(folder, n=4, size=5000, keep=None):
    """_weights_model's tensors written to the staging folder's scratch file as the trace writes
    them (onnx_ir, aligned), then only `keep` of them named by the graph."""
    import onnx
    import onnx_ir as ir
    model = ir.serde.deserialize_model(_weights_model(n, size))
    ir.external_data.unload_from_model(model, folder, F.SCRATCH, size_threshold_bytes=F.EXTERNAL_MIN,
                                       alignment=F.EXTERNAL_ALIGN, align_threshold=0)
    proto = ir.serde.serialize_model(model)
    if keep is not None:
        gone = [i for i in proto.graph.initializer if i.name.startswith("w") and i.name not in keep]
        for init in gone:
            proto.graph.initializer.remove(init)
            proto.graph.initializer.append(onnx.numpy_helper.from_array(
                onnx.numpy_helper.to_array(init, str(folder)) * 0 + 9.0, init.name))  # made again in memory
    return proto


@pytest.mark.parametrize("keep, adopted", [(None, True), ({"w0"}, True), ({"w3"}, False)])
def test_the_traces_scratch_file_becomes_the_data_file_where_the_graph_still_names_it(tmp_path, keep, adopted):
    import numpy as np
    import onnxruntime as ort
    staged = F.new_staging(tmp_path / "m.onnx")
    model = _scratch_model(staged.folder, keep=keep)
    inode = (staged.folder / F.SCRATCH).stat().st_ino
    F.stage_external(model, staged.target, staged)
    assert not (staged.folder / F.SCRATCH).exists()
    assert (staged.data.stat().st_ino == inode) is adopted  # renamed, not written again
    session = ort.InferenceSession(str(staged.graph), providers=["CPUExecutionProvider"])
    got = session.run(["y0", "y1", "y3"], {"x": np.zeros(5000, np.float32)})
    assert [float(y[0]) for y in got] == {None: [0.5, 1.5, 3.5], "w0": [0.5, 9.0, 9.0],
                                          "w3": [9.0, 9.0, 3.5]}[keep and min(keep)]
    del session
    staged.commit()
    size = (tmp_path / "m.onnx_data").stat().st_size
    assert size < 4 * F.EXTERNAL_ALIGN + 20000  # what was dropped is not kept


def test_the_last_tensors_fill_the_holes_the_dropped_ones_left():
    a = F.EXTERNAL_ALIGN
    # A tied embedding dropped from the start, its transpose (the same size) written at the end.
    moves, end = F._compacted([(2 * a, 10), (3 * a, 5 * a), (10 * a, 2 * a)])
    assert moves == {(10 * a, 2 * a): 0} and end == 8 * a
    # Two tail tensors into one hole, then one that fits nowhere stays and sets the end.
    moves, end = F._compacted([(0, a), (3 * a, 4 * a), (8 * a, 10), (9 * a, 100)])
    assert moves == {(9 * a, 100): a, (8 * a, 10): 2 * a} and end == 7 * a
    assert F._compacted([(0, a), (a, a)]) == ({}, 2 * a)


def test_a_full_disk_while_the_data_is_written_leaves_nothing(tmp_path, monkeypatch):
    import errno
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UsageError, match="No space left"):
        F.stage_external(_weights_model(), tmp_path / "m.onnx")
    monkeypatch.setattr(os, "fsync", real)
    assert list(tmp_path.iterdir()) == []


def test_a_data_file_that_is_a_link_is_written_through_and_a_fifo_is_refused_before_anything(tmp_path):
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    (elsewhere / "real_data").write_bytes(b"old")
    (tmp_path / "m.onnx_data").symlink_to(elsewhere / "real_data")
    F.stage_external(_weights_model(), tmp_path / "m.onnx").commit()
    assert (tmp_path / "m.onnx_data").is_symlink() and (elsewhere / "real_data").stat().st_size > 15000
    os.mkfifo(tmp_path / "p.onnx_data")
    with pytest.raises(UsageError, match="FIFO"):
        F.stage_external(_weights_model(), tmp_path / "p.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx_data", "p.onnx_data", "store"]


def test_a_model_above_one_protobuf_message_is_refused_in_one_line_before_onnx_runtime_or_a_write(monkeypatch):
    """Above protobuf's 2 GB (lowered here) a ModelProto cannot be serialized: ONNX Runtime's
    sessions and the one-file write say so and name --external-data, not protobuf's EncodeError."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from attnexport import runtimes as R
    from attnexport.errors import UsageError
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [256])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [256])],
                              [numpy_helper.from_array(np.ones(256, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    F.fits_one_message(model)
    R.prepare_onnx("ort-cpu", model)  # below the limit: runs
    monkeypatch.setattr(F, "PROTOBUF_LIMIT", 512)
    with pytest.raises(UsageError, match=r"above the 2 GB protobuf holds.*--external-data"):
        F.fits_one_message(model)
    with pytest.raises(UsageError, match="--external-data"):
        R.prepare_onnx("ort-cpu", model)
