"""The options of export, verify and bench (`attnexport.options`): declared once, on the command
line as declared, read by the library against the same table (its defaults, the rest as variant
options), and a misspelt keyword not taken silently."""

import pytest

from attnexport import commands
from attnexport import options as O
from attnexport.cli import bench, export, verify
from attnexport.errors import UsageError


@pytest.mark.parametrize(("command", "table"), [(export, O.EXPORT), (verify, O.VERIFY), (bench, O.BENCH)])
def test_each_command_shows_its_table_once_in_order(command, table):
    names = [p.name for p in command.params]
    assert [n for n in names if n in {o.name for o in table}] == [o.name for o in table]
    assert len(names) == len(set(names))  # no option declared twice (the variant options come after)


def test_the_library_reads_the_tables_defaults_and_leaves_the_rest_to_the_variant():
    a, rest = O.read(O.EXPORT, {"variant": "mha", "heads": 4, "nan_rows": True})
    assert a.variant == "mha" and a.nan_rows is True and rest == {"heads": 4}
    # --seed: None, read as 0, except that --hf refuses a folder with a config and no weights unless it is given
    assert a.flavor == "attention" and a.dtype == "fp32" and a.seed is None and a.input_specs == () and a.rtol is None
    v, _ = O.read(O.VERIFY, {})
    assert v.max_growth == 10.0 and v.new_tokens == 48 and v.variants == () and v.localize is False
    b, _ = O.read(O.BENCH, {})
    assert (b.warmup, b.iters, b.repeat, b.dtype) == (5, 30, 5, "fp32") and b.precisions_text is None


def test_a_misspelt_keyword_is_refused_not_dropped(tmp_path):
    with pytest.raises(UsageError, match="hedas"):
        commands.export("mha", hedas=4, output=str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


def test_every_verify_mode_takes_the_checking_options_by_their_declared_names():
    # One declaration of where and how strictly verify runs (verify.request.Checking), shared by
    # the golden/model, module and language-model requests; the command line's options bear the
    # same names and defaults, so commands passes them on without naming them.
    import dataclasses

    from attnexport.pretrained.check import HFCheck
    from attnexport.verify.module_check import ModuleCheck
    from attnexport.verify.request import Checking, VerifyRequest
    v, _ = O.read(O.VERIFY, {})
    for f in dataclasses.fields(Checking):
        assert getattr(v, f.name) == (f.default if not isinstance(f.default, list) else ()), f.name
    for request in (VerifyRequest, ModuleCheck, HFCheck):
        assert issubclass(request, Checking)
    got = Checking.taken(O.read(O.VERIFY, {"max_growth": 3.0, "baseline": "b"})[0])
    assert got["max_growth"] == 3.0 and got["baseline"] == "b"


def test_pick_passes_each_option_a_request_has_by_its_name():
    a, _ = O.read(O.EXPORT, {"variant": "mha", "seed": 7, "dtype": "fp16"})
    from attnexport.export import ExportRequest
    picked = O.pick(a, ExportRequest, options={"heads": 2})
    assert picked["seed"] == 7 and picked["dtype"] == "fp16" and picked["options"] == {"heads": 2}
    assert "params" not in picked and "use_cache" not in picked  # what the command line does not hold


def test_commands_never_restate_an_option_by_name():
    # `name=a.name` (passed on as given) in commands.py is an option written a third time: O.pick
    # passes it on; what commands changes on the way (`name=a.name or None`) is its own.
    import re
    from pathlib import Path
    text = Path(commands.__file__).read_text()
    names = {o.name for table in (O.EXPORT, O.VERIFY, O.BENCH) for o in table}
    restated = sorted(n for n in names if re.search(rf"\b{n}\s*=\s*a\.{n}\s*[,)]", text))
    assert restated == []
