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
    verify exports it (one export per graph: sizes are symbolic), in fp32: float16 inputs keep a
    node on the device, so an fp16 graph moves no more than its fp32 twin."""
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
        moved, copies = cuda_placement(model)
        moved = [n for n in moved if n not in shapes]
        if moved or copies:
            bad.append(f"{case.name}: on the CPU {moved}, copied from the host {copies}")
    assert len(graphs) > 30
    assert not bad, "\n".join(bad)
