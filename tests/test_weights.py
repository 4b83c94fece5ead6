"""weights: parameter fingerprints recorded at export, read back, and reweighting an export."""

import numpy as np
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
