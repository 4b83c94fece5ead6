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
    assert a.flavor == "attention" and a.dtype == "fp32" and a.seed == 0 and a.input_specs == () and a.rtol is None
    v, _ = O.read(O.VERIFY, {})
    assert v.max_growth == 10.0 and v.new_tokens == 48 and v.variants == () and v.localize is False
    b, _ = O.read(O.BENCH, {})
    assert (b.warmup, b.iters, b.repeat, b.dtype) == (5, 30, 5, "fp32") and b.precisions_text is None


def test_a_misspelt_keyword_is_refused_not_dropped(tmp_path):
    with pytest.raises(UsageError, match="hedas"):
        commands.export("mha", hedas=4, output=str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
