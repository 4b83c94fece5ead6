import json
import shutil

import numpy as np
import pytest

from attnexport import cases, golden
from attnexport.errors import GoldenIntegrityError


def test_check_is_clean():
    assert golden.check() == []


def test_write_is_deterministic_on_one_machine(tmp_path):
    """Two writes on one machine give the same bytes (the manifest's sha256 pins them)."""
    golden.write(tmp_path / "a")
    golden.write(tmp_path / "b")
    assert golden.read_manifest(tmp_path / "a") == golden.read_manifest(tmp_path / "b")


def test_write_matches_the_shipped_cases_array_by_array(tmp_path):
    """On another CPU the float64 reference may differ in its last bits (numpy's vectorised
    math and OpenBLAS are chosen by CPU), so regenerated files need not hash the same as the
    shipped ones: they must hold the same inputs and parameters, and expected outputs within
    golden.EXPECTED_BOUND."""
    golden.write(tmp_path)
    for name in golden.CASES:
        assert golden.differences(golden.load(name), golden.load(name, tmp_path)) == [], name


def _shifted(case, delta):
    expected = {k: v + delta for k, v in case.expected.items()}
    return golden.GoldenCase(case.name, case.variant, case.options, case.inputs, case.params, expected, case.meta)


def test_expected_bound_passes_last_bits_and_fails_a_real_change():
    """The bound from both sides: a difference of a few ulps (what another CPU gives) passes, one
    of 1e-9 (far below any tolerance of a runtime, far above rounding) fails, NaN fails."""
    case = golden.load("mha-seeded")
    scale = float(np.max(np.abs(case.expected["output"])))
    assert golden.EXPECTED_BOUND == 1e-12
    assert golden.differences(case, _shifted(case, 4e-15)) == []
    assert golden.differences(case, _shifted(case, 0.9e-12 * scale)) == []
    assert golden.differences(case, _shifted(case, 1.1e-12 * scale)) != []
    assert "max diff 1e-09" in golden.differences(case, _shifted(case, 1e-9))[0]
    assert "NaN" in golden.differences(case, _shifted(case, np.nan))[0]


def test_inputs_and_params_match_to_their_last_unit():
    """One ulp of the stored dtype passes (a vectorised sin may round the other way on another
    CPU); two fail, as does any change to an integer input."""
    case = golden.load("mha-seeded")
    name = next(iter(case.params))
    w = case.params[name]

    def with_param(value):
        params = dict(case.params, **{name: value})
        return golden.GoldenCase(case.name, case.variant, case.options, case.inputs, params, case.expected,
                                 case.meta)
    one_ulp = np.nextafter(w, np.inf)
    assert golden.differences(case, with_param(one_ulp)) == []
    assert golden.differences(case, with_param(np.nextafter(one_ulp, np.inf))) == [f"params {name} differs"]
    lens = golden.load("additive-valid-lens")
    inputs = dict(lens.inputs, valid_lens=lens.inputs["valid_lens"] + 1)
    other = golden.GoldenCase(lens.name, lens.variant, lens.options, inputs, lens.params, lens.expected, lens.meta)
    assert golden.differences(lens, other) == ["inputs valid_lens differs"]


def test_cases_carry_provenance():
    case = golden.load("kernel-nadaraya-watson")
    assert case.meta["seed"] == cases.seed_of("kernel-nadaraya-watson") and "2 sin(x) + x^0.8" in case.meta["source"]
    assert case.meta["provenance"]["reference"] == "attnexport.reference.ref_kernel"
    assert set(case.inputs) == {"queries", "keys", "values"}


@pytest.fixture
def golden_copy(tmp_path):
    d = tmp_path / "golden"
    shutil.copytree(golden.default_dir(), d)
    return d


def test_damaged_file_is_caught(golden_copy):
    path = golden_copy / "mha-seeded.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenIntegrityError, match="mha-seeded.npz.*sha256"):
        golden.load("mha-seeded", golden_copy)


def test_missing_file_is_caught(golden_copy):
    (golden_copy / "kernel-seeded.npz").unlink()
    with pytest.raises(GoldenIntegrityError, match="missing.*kernel-seeded.npz"):
        golden.load("kernel-seeded", golden_copy)


def test_drift_is_reported(golden_copy):
    case = golden.load("posenc-seeded", golden_copy)
    case.expected["output"] = case.expected["output"] + 1e-3
    data = golden._to_bytes(case)
    (golden_copy / "posenc-seeded.npz").write_bytes(data)
    manifest = json.loads((golden_copy / golden.MANIFEST).read_text())
    manifest["files"]["posenc-seeded.npz"] = golden.sha256(data)
    (golden_copy / golden.MANIFEST).write_text(json.dumps(manifest))
    drift = golden.check(golden_copy)
    assert [d.case for d in drift] == ["posenc-seeded"]
    assert "max diff 0.001" in drift[0].what


def test_expected_values_come_from_the_reference_not_the_modules(monkeypatch):
    """Regenerating cases runs no module and no torch attention (torch only gives the parameters'
    names and shapes; their values are drawn with NumPy), and gives the shipped values."""
    import torch

    import attnexport.models.core  # noqa: F401 - it binds torch's kernel at import: before the patch

    def refuse(*args, **kwargs):
        raise AssertionError("a module ran while golden values were generated")
    monkeypatch.setattr(torch.nn.Module, "__call__", refuse)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    monkeypatch.setattr(torch.Tensor, "__matmul__", refuse)
    for name in ("sdpa-seeded", "mha-kv-cache", "decoder-padding", "kernel-nadaraya-watson", "additive-valid-lens"):
        assert golden.differences(golden.load(name), golden.generate(golden.CASES[name])) == [], name


def test_installed_wheel_ships_the_golden_cases():
    """The golden folder travels inside the wheel, so verify works from any directory. From a
    wheel install (CI's), the installed files are checked; from an editable one, the build
    configuration that puts them there."""
    from importlib import metadata

    import tomllib
    from conftest import ROOT
    try:
        files = metadata.files("attnexport") or []
    except metadata.PackageNotFoundError:
        files = []
    shipped = {str(f) for f in files}
    if files and not any(f.endswith(".pth") for f in shipped):
        assert "attnexport/golden/MANIFEST.json" in shipped
        assert len([f for f in shipped if f.startswith("attnexport/golden/") and f.endswith(".npz")]) == \
            len(golden.CASES)
    else:  # editable (or not installed): the wheel's build configuration maps golden/ into the package
        build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]
        assert build["wheel"]["force-include"] == {"golden": "attnexport/golden"}
        assert "golden" in build["sdist"]["include"]
        assert len(list((ROOT / "golden").glob("*.npz"))) == len(golden.CASES)


def test_a_missing_manifest_is_a_typed_error(tmp_path):
    with pytest.raises(GoldenIntegrityError, match="golden manifest missing"):
        golden.manifest_hash(tmp_path)
    with pytest.raises(GoldenIntegrityError, match="golden manifest missing"):
        golden.read_manifest(tmp_path)


def test_the_semantics_leaf_imports_nothing_of_torch_or_attnexport():
    """The operator's enumerations live in a leaf both the models and the registry read: no
    cycle between them, and `list` and the reference need no torch."""
    import ast

    from conftest import ROOT
    tree = ast.parse((ROOT / "attnexport" / "semantics.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and set(imported) <= {"__future__", "dataclasses"}, imported  # the standard library only
    core = (ROOT / "attnexport" / "models" / "core.py").read_text()
    assert "from attnexport import variants" not in core and "import attnexport.variants" not in core
