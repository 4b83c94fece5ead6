"""weights: parameter fingerprints recorded at export, read back, and reweighting an export."""

import numpy as np
import onnx
import pytest

from attnexport import export as E
from attnexport import seeding
from attnexport import variants as V
from attnexport import weights as W
from attnexport.errors import UsageError


@pytest.fixture(scope="module")
def mha():
    v = V.get("mha")
    o = v.resolve({"heads": 2, "dim": 16})
    model, _ = E.build_model("mha", o, "primitives")
    from attnexport.record import ExportRecord
    return v, o, model, ExportRecord.of(model).parsed("params")


def test_read_gives_back_the_parameters_and_finds_a_changed_one(mha):
    from onnx import numpy_helper
    v, o, model, entries = mha
    params, changed = W.read(model, entries)
    seeded = seeding.init_params(v, o, 0)
    assert changed == [] and set(params) == set(seeded)
    assert all(np.array_equal(params[k], seeded[k]) for k in seeded)
    edited = type(model)()
    edited.CopyFrom(model)
    init = next(i for i in edited.graph.initializer if i.name == entries["q_proj.weight"]["initializer"])
    arr = numpy_helper.to_array(init).copy()
    arr.flat[0] += 1.0
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    assert W.read(edited, entries)[1] == ["q_proj.weight"]


def test_reweight_holds_what_was_asked_and_refuses_another_parameter_set(mha):
    v, o, model, entries = mha
    other = seeding.init_params(v, o, 7)
    reweighted = W.reweight(model, entries, other)
    from attnexport.record import ExportRecord
    params, changed = W.read(reweighted, ExportRecord.of(reweighted).parsed("params"))
    assert changed == [] and all(np.array_equal(params[k], other[k]) for k in other)
    assert W.reweight(model, entries, {k: x for k, x in other.items() if k != "q_proj.weight"}) is None


def test_validate_names_what_does_not_fit():
    v = V.get("mha")
    o = v.resolve({"heads": 2, "dim": 16})
    good = seeding.init_params(v, o, 0)
    with pytest.raises(UsageError, match="non-finite"):
        W.validate(v, o, {**good, "q_proj.weight": np.full_like(good["q_proj.weight"], np.nan)})
    with pytest.raises(UsageError):
        W.validate(v, o, {k: x for k, x in good.items() if k != "q_proj.bias"})
    assert W.sha256_of(good["q_proj.weight"]) == W.sha256_of(good["q_proj.weight"].copy())


def test_the_skeleton_of_a_model_holds_no_weight_yet_passes_onnx_checks_as_the_model_does():
    import onnx
    from onnx import helper, numpy_helper
    w = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 256])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, None])], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    before = model.SerializeToString()
    skeleton = W.skeleton(model)
    assert model.SerializeToString() == before  # the model itself untouched
    assert [i.name for i in skeleton.graph.initializer] == ["shape"]  # an integer one stays: shapes read it
    assert [i.name for i in skeleton.graph.input] == ["x", "w"] and skeleton.ByteSize() < 4096
    onnx.checker.check_model(skeleton, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=True, data_prop=True)
    assert inferred.graph.output[0].type.tensor_type.shape.dim[0].dim_value == 1
    assert W.skeleton(model, threshold=1 << 30).graph.initializer[0].name == "w"  # below it: kept


def test_unload_writes_each_weight_aligned_and_a_transposed_one_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """What the exporter hands over (a parameter's view, the transpose of one, a small tensor left in the
    graph) written to the data file: every byte as NumPy holds it, each tensor at a multiple of the alignment."""
    ir = pytest.importorskip("onnx_ir")
    monkeypatch.setattr(W, "TRANSPOSE_BYTES", 3 * 7 * 4)  # three rows of the transpose at a time
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((7, 10)).astype(np.float32)
    arrays = {"plain": rng.standard_normal((5, 6)).astype(np.float32), "turned": weight.T,
              "ids": np.arange(40, dtype=np.int64), "small": np.ones(2, np.float32)}
    values = [ir.Value(name=n, const_value=ir.Tensor(a, name=n)) for n, a in arrays.items()]
    torch = pytest.importorskip("torch")
    table = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32))  # a parameter the graph reads as it is
    from onnx_ir.tensor_adapters import TorchTensor
    values.append(ir.Value(name="table", const_value=TorchTensor(table, name="table")))
    arrays["table"] = table.numpy()
    graph = ir.Graph([], [], nodes=[], initializers=values, name="g")
    with W.external_base(tmp_path):
        W.unload(ir.Model(graph, ir_version=10), tmp_path, "w.data", threshold=64, alignment=128)
        written = W._WRITTEN.get()
    data = (tmp_path / "w.data").read_bytes()
    for v in values:
        name, t = v.name, v.const_value
        if name == "small":
            assert not isinstance(t, ir.ExternalTensor)
            continue
        assert isinstance(t, ir.ExternalTensor) and t.offset % 128 == 0
        assert data[t.offset:t.offset + t.length] == np.ascontiguousarray(arrays[name]).tobytes(), name
        # each fingerprinted as written, as the record would hash it from the file, and known by its memory
        place = written.source[W._memory(arrays[name])]
        assert place[:3] == ("w.data", t.offset, t.length)
        init = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(arrays[name].dtype),
                                dims=arrays[name].shape, data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", "w.data"), ("offset", str(t.offset)), ("length", str(t.length))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
        assert W._place(init) == place
        assert written.at[place] == W._sha256_of_initializer(init, str(tmp_path))
        assert written.at[place][0] == W.sha256_of(arrays[name])


def test_work_beside_the_write_runs_on_its_own_thread_and_its_error_comes_after(tmp_path):
    """`unload(beside=...)`: the work runs on a thread of its own while the weights are written; a
    parameter it swaps for a float64 copy meanwhile (as the float64 reference does, a module at a time)
    is written as it was when the write began; the work's error is raised once every weight is written."""
    ir = pytest.importorskip("onnx_ir")
    torch = pytest.importorskip("torch")
    import threading

    from onnx_ir.tensor_adapters import TorchTensor
    norm = torch.nn.Parameter(torch.arange(64, dtype=torch.float32))
    kept = norm.detach().numpy().copy()

    def values():  # the parameter after a weight large enough for the work to have swapped it by then
        return [ir.Value(name="w", const_value=ir.Tensor(np.ones((1024, 1024), np.float32), name="w")),
                ir.Value(name="norm", const_value=TorchTensor(norm, name="norm"))]
    seen = {}

    def swap():
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        norm.data = norm.data.double()  # what the reference's hook does while the module runs
    made = values()
    with W.external_base(tmp_path):
        W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=made, name="g"), ir_version=10), tmp_path,
                 "w.data", threshold=64, alignment=128, beside=swap)
    assert seen == {"thread": True}
    at = made[1].const_value
    assert (tmp_path / "w.data").read_bytes()[at.offset:at.offset + at.length] == kept.tobytes()

    norm.data = torch.from_numpy(kept.copy())

    def fails():
        raise RuntimeError("the reference failed")
    with W.external_base(tmp_path), pytest.raises(RuntimeError, match="the reference failed"):
        W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=values(), name="g"), ir_version=10), tmp_path,
                 "x.data", threshold=64, alignment=128, beside=fails)
    assert (tmp_path / "x.data").stat().st_size == 1024 * 1024 * 4 + 64 * 4  # every weight written first


def test_ctrl_c_during_the_write_does_not_wait_for_the_work_beside_it(tmp_path, monkeypatch):
    """A KeyboardInterrupt while the weights are written goes up at once: the work beside the write
    (a daemon thread) is not waited for, where any other error waits for it."""
    ir = pytest.importorskip("onnx_ir")
    import threading
    import time
    release = threading.Event()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(W, "_write_tensor", interrupted)
    value = ir.Value(name="w", const_value=ir.Tensor(np.ones((64, 64), np.float32), name="w"))
    start = time.perf_counter()
    try:
        with W.external_base(tmp_path), pytest.raises(KeyboardInterrupt):
            W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=[value], name="g"), ir_version=10), tmp_path,
                     "w.data", threshold=64, alignment=128, beside=lambda: release.wait(60))
        assert time.perf_counter() - start < 30
    finally:
        release.set()


def test_a_table_is_turned_from_the_memory_it_was_written_from_or_else_from_the_file(tmp_path):
    """`transposed_external`: a table `unload` wrote is turned from its memory, written in order and
    fingerprinted as written (the record reads nothing back), over the table's own bytes where the
    table is let go; one written otherwise is turned from the file. Each way the file then holds the
    transpose at an aligned offset."""
    ir = pytest.importorskip("onnx_ir")
    rng = np.random.default_rng(3)
    table = rng.standard_normal((37, 12)).astype(np.float32)
    with W.external_base(tmp_path):
        value = ir.Value(name="table", const_value=ir.Tensor(table, name="table"))
        W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=[value], name="g"), ir_version=10), tmp_path,
                 "w.data", threshold=64, alignment=128)
        written = W._WRITTEN.get()
        t = value.const_value
        init = onnx.TensorProto(name="table", data_type=onnx.TensorProto.FLOAT, dims=[37, 12],
                                data_location=onnx.TensorProto.EXTERNAL)
        for key, v in (("location", "w.data"), ("offset", str(t.offset)), ("length", str(t.length))):
            entry = init.external_data.add()
            entry.key, entry.value = key, v
        from_memory = W.transposed_external(init, "a", alignment=128)
        held = dict(written.arrays)
        written.arrays.clear()  # as after the record: turned from the file
        from_file = W.transposed_external(init, "b", alignment=128)
        size = (tmp_path / "w.data").stat().st_size
        written.arrays.update(held)
        over = W.transposed_external(init, "c", alignment=128, over=True)  # the table let go: written over it
    data = (tmp_path / "w.data").read_bytes()
    assert len(data) == size and {e.key: e.value for e in over.external_data}["offset"] == str(t.offset)
    for turned in (from_memory, from_file, over):
        info = {e.key: e.value for e in turned.external_data}
        offset, length = int(info["offset"]), int(info["length"])
        assert offset % 128 == 0 and list(turned.dims) == [12, 37]
        assert data[offset:offset + length] == np.ascontiguousarray(table.T).tobytes(), turned.name
    for turned in (from_memory, over):
        assert written.at[W._place(turned)] == W._sha256_of_initializer(turned, str(tmp_path))
    assert W._place(from_file) not in written.at


def test_row_blocks_reuse_one_scratch_buffer_from_array_to_array():
    """A transposed array is made contiguous in the scratch's buffer, kept from one array to the next
    (a fresh one per array cost the kernel's page faults every time)."""
    scratch, rng = W.Scratch(), np.random.default_rng(2)
    seen = set()
    for shape in ((40, 30), (30, 40), (8, 8)):
        a = rng.standard_normal(shape).astype(np.float32)
        blocks = []
        for block in W.row_blocks(a.T, 7 * shape[0] * 4, scratch):
            blocks.append(bytes(block))
            seen.add(np.frombuffer(block, np.uint8).__array_interface__["data"][0])
        assert b"".join(blocks) == np.ascontiguousarray(a.T).tobytes()
    assert len(seen) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_a_transposed_view_hashes_as_its_contiguous_copy_a_block_of_rows_at_a_time(monkeypatch, dtype):
    monkeypatch.setattr(W, "CHUNK_BYTES", 64)  # a few rows a block
    a = (np.random.default_rng(1).standard_normal((9, 13)) * 100).astype(dtype)
    assert W.sha256_of(a.T) == W.sha256_of(np.ascontiguousarray(a.T)) != W.sha256_of(a)
    assert W.sha256_of(a[:, ::2]) == W.sha256_of(np.ascontiguousarray(a[:, ::2]))


def test_matrices_written_before_the_trace_are_named_where_they_were_written(tmp_path):
    """`Prewrite` writes the module's matrices as `planned` guesses the graph holds them (a Linear's
    weight turned, an embedding's table as it is) while the caller traces; `unload(early=...)` names
    each initializer that is one of them where it was written (same bytes, fingerprinted as written),
    appends the rest after them, and leaves a planned matrix the graph does not hold as a hole."""
    ir = pytest.importorskip("onnx_ir")
    torch = pytest.importorskip("torch")
    from onnx_ir.tensor_adapters import TorchTensor
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"embed": torch.nn.Embedding(300, 16), "up": torch.nn.Linear(16, 40),
                                  "unused": torch.nn.Linear(16, 20, bias=False)})
    planned = W.planned(module, threshold=1024)
    assert [a.shape for a in planned] == [(300, 16), (16, 40), (16, 20)]  # the Linears' turned
    early = W.Prewrite(planned, tmp_path / "w.data", 128)
    table, up = module["embed"].weight.detach(), module["up"].weight.detach()
    values = [ir.Value(name="table", const_value=TorchTensor(table, name="table")),
              ir.Value(name="up", const_value=TorchTensor(up.T, name="up")),  # the view the exporter folds
              ir.Value(name="other", const_value=ir.Tensor(np.full((30, 30), 2, np.float32), name="other"))]
    with W.external_base(tmp_path):
        W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=values, name="g"), ir_version=10), tmp_path,
                 "w.data", threshold=64, alignment=128, early=early)
        written = W._WRITTEN.get()
    data = (tmp_path / "w.data").read_bytes()
    wanted = {"table": table.numpy(), "up": up.numpy().T, "other": np.full((30, 30), 2, np.float32)}
    offsets = {}
    for v in values:
        t = v.const_value
        assert isinstance(t, ir.ExternalTensor) and t.offset % 128 == 0
        assert data[t.offset:t.offset + t.length] == np.ascontiguousarray(wanted[v.name]).tobytes(), v.name
        place = written.source[W._memory(wanted[v.name])] if v.name != "other" else None
        if place is not None:
            assert written.at[place][0] == W.sha256_of(wanted[v.name])
        offsets[v.name] = t.offset
    unused = module["unused"].weight.detach().numpy().T
    assert offsets["other"] > max(offsets["table"], offsets["up"])  # appended after what was written early
    assert np.ascontiguousarray(unused).tobytes() in data  # written early, named by nothing: a hole
    assert W._memory(unused) not in written.source


def test_an_early_write_that_fails_says_so_when_its_weights_are_needed(tmp_path):
    """A write before the trace that fails (here: its folder is gone) raises at `unload`, as a full
    disk there does (one line), and `cancel` stops one whose export failed before."""
    ir = pytest.importorskip("onnx_ir")
    early = W.Prewrite([np.ones((64, 64), np.float32)], tmp_path / "gone" / "w.data", 128)
    value = ir.Value(name="w", const_value=ir.Tensor(np.ones((64, 64), np.float32), name="w"))
    with W.external_base(tmp_path), pytest.raises(UsageError, match="cannot write the weights"):
        W.unload(ir.Model(ir.Graph([], [], nodes=[], initializers=[value], name="g"), ir_version=10), tmp_path,
                 "w.data", threshold=64, alignment=128, early=early)
    import time

    def slow():  # the second matrix comes after the cancel
        yield np.ones((64, 64), np.float32)
        time.sleep(0.5)
        yield np.ones((64, 64), np.float32)
    stopped = W.Prewrite(slow(), tmp_path / "x.data", 128)
    stopped.cancel()
    assert not stopped.thread.is_alive()
    assert (tmp_path / "x.data").stat().st_size in (0, 64 * 64 * 4)  # the first at most, never the second
