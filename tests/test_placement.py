"""Where ONNX Runtime's CUDA provider would run each exported graph, checked without a GPU
(tests/ort_placement.py): what a CUDA graph's capture needs holds for every golden case."""

import pytest
from ort_placement import cuda_placement

from attnexport import export as E
from attnexport import golden
from attnexport import runtimes as R
from attnexport import variants as V
from attnexport.errors import UnsupportedByFlavor


@pytest.mark.parametrize("flavor", E.FLAVORS)
def test_every_golden_graph_keeps_its_values_on_the_cuda_device(flavor):
    """ONNX Runtime's CUDA provider moves a node to the CPU when its inputs are graph inputs and
    values computed from shapes (tests/ort_placement.py follows its rule), and a CUDA graph's
    capture refuses any CPU node but shape arithmetic and any copy from the host. On an H100 the
    static cache's valid count (write_pos + T), its key mask and causal offset, a concat cache's
    causal offset (past + i) and sdpa's 1/sqrt(d) once ran on the CPU or were copied in, and no
    step over a static cache could be captured. Checked for the graph of every golden case, as
    verify exports it (one export per graph: sizes are symbolic), in fp32 with every kernel assumed
    (float16 inputs keep a node on the device, so an fp16 graph moves no more than its fp32 twin;
    the fp32 kernels CUDA lacks are the next test's)."""
    bad, graphs = [], set()
    for case in golden.load_all():
        variant = V.get(case.variant)
        key = (case.variant, repr(sorted(variant.graph_options(case.options).items())))
        if key in graphs:
            continue
        graphs.add(key)
        try:
            model = E.build_model(case.variant, case.options, E.graph_flavor(variant, flavor))[0]
        except UnsupportedByFlavor:
            continue
        shapes = R.shape_computations(model)
        moved, copies = cuda_placement(model, missing_kernels=False)
        moved = [n for n in moved if n not in shapes]
        if moved or copies:
            bad.append(f"{case.name}: on the CPU {moved}, copied from the host {copies}")
    assert len(graphs) > 30
    assert not bad, "\n".join(bad)


def test_the_ort_static_step_stays_on_the_device_in_fp16_and_says_where_fp32_goes():
    """The ort flavour's static step is GroupQueryAttention, which ONNX Runtime's CUDA provider runs
    in float16 only: the fp16 graph keeps every node on the device with no copy, the fp32 one runs
    that node on the CPU with its inputs and outputs copied (an H200 found it so, 2026-11-26)."""
    from attnexport import seeding
    v = V.get("mha")
    o = v.resolve({"kv_cache": True, "max_seq": 12, "causal": True, "kv_heads": 2, "seq": 1, "past_seq": 5})
    params = seeding.init_params(v, o, 0)
    for dtype in ("fp16", "fp32"):
        model = E.build_model("mha", o, "ort", params=params, dtype=dtype)[0]
        shapes = R.shape_computations(model)
        moved, copies = cuda_placement(model)
        moved = [n for n in moved if n not in shapes]
        if dtype == "fp16":
            assert not moved and not copies, (moved, copies)
        else:
            assert [n.split(":")[0] for n in moved] == ["GroupQueryAttention"], moved
            assert any(c.endswith("(to the host)") for c in copies), copies


def test_a_total_length_computed_on_the_device_is_a_copy_to_the_host():
    """What kept the static step out of every CUDA graph before (H200, 2026-11-26): the operator's
    total_sequence_length as the largest valid count, computed from device-held positions."""
    from onnx import helper

    from attnexport import seeding
    v = V.get("mha")
    o = v.resolve({"kv_cache": True, "max_seq": 12, "causal": True, "kv_heads": 2, "seq": 1, "past_seq": 5})
    model = E.build_model("mha", o, "ort", params=seeding.init_params(v, o, 0), dtype="fp16")[0]
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    model.graph.node.extend([helper.make_node("ReduceMax", ["write_pos"], ["old_max"], "old_max", keepdims=0),
                             helper.make_node("Cast", ["old_max"], ["old_total"], "old_total", to=6)])
    gqa.input[6] = "old_total"
    _, copies = cuda_placement(model)
    assert any(c.startswith("GroupQueryAttention:") and "old_total (to the host)" in c for c in copies), copies
