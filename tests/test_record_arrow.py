"""A recording's Arrow columns are built from their buffers (capture.record_writer.arrow_array), not with
`pyarrow.array`, which imports pandas into the training process on its first call (47 MB of its memory)."""

import math
import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphviz_core.capture.record_writer import arrow_array
from graphviz_core.graph.recording import arrow_schemas

floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32))
COLUMNS = {
    pa.int64(): st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    pa.int32(): st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
    pa.float64(): floats,
    pa.float32(): floats,
    pa.bool_(): st.one_of(st.none(), st.booleans()),
    pa.string(): st.one_of(st.none(), st.text()),
    pa.list_(pa.float64()): st.one_of(st.none(), st.lists(floats, max_size=4)),
    pa.list_(pa.string()): st.one_of(st.none(), st.lists(st.text(max_size=5), max_size=4)),
    pa.list_(pa.int32()): st.one_of(st.none(), st.lists(st.integers(-2**31, 2**31 - 1), max_size=4)),
}


def _same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


@pytest.mark.parametrize("kind", list(COLUMNS), ids=str)
@given(data=st.data())
def test_each_column_type_reads_back_as_pyarrow_builds_it(kind, data):
    values = data.draw(st.lists(COLUMNS[kind], max_size=12))
    built = arrow_array(values, kind)
    built.validate(full=True)
    expected = pa.array(values, type=kind)  # pyarrow's own conversion, the reference
    assert built.type == kind and built.null_count == expected.null_count
    assert _same(built.to_pylist(), expected.to_pylist())


def test_every_schema_type_is_built():
    kinds = {f.type for schema in arrow_schemas().values() for f in schema}
    assert kinds <= set(COLUMNS)  # a new column type needs its case in arrow_array (and here)


def test_recording_a_loop_imports_no_pandas(tmp_path):
    script = f"""
import sys, torch, graphviz_core
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with graphviz_core.record({str(tmp_path / "run")!r}, model=model):
    for _ in range(3):
        model(torch.randn(6, 8)).sum().backward(); opt.step(); opt.zero_grad()
assert "pyarrow" in sys.modules, "the recording was written with pyarrow"
print("pandas" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
