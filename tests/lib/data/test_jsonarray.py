"""JSON array files (posttrain.data.jsonarray) read through `RowStream`: rows numbered as in
the array, resumption from a saved position, malformed arrays and non-object rows."""

import json

import pytest

from posttrain.data.jsonarray import JsonArray
from posttrain.data.sources import RowStream
from posttrain.errors import DataError


def test_json_array_rows_are_numbered_and_resume(tmp_path, monkeypatch):
    """Rows of a JSON array are numbered 1, 2, ... (what errors name), and a stream resumed from
    a saved position, read with a chunk smaller than a row, yields exactly the rest."""
    monkeypatch.setattr(JsonArray, "CHUNK", 16)
    rows = [{"i": i, "text": "é" * i} for i in range(12)]
    path = tmp_path / "rows.json"
    path.write_text("\ufeff [" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
                    + "]\n", encoding="utf-8")
    with RowStream([str(path)]) as stream:
        it = iter(stream)
        head = [next(it) for _ in range(5)]
        state = json.loads(json.dumps(stream.state_dict()))
    assert [r.line for r in head] == [1, 2, 3, 4, 5]
    with RowStream([str(path)]) as resumed:
        resumed.load_state_dict(state)
        tail = list(resumed)
    assert [r.data for r in head + tail] == rows and [r.line for r in tail] == list(range(6, 13))
    path.write_text('[{"i": 0}, 7, {"i": 2} {"i": 3}]')
    with pytest.raises(DataError, match=r"rows.json:4: row 4 of the JSON array") as e:
        [r.error and r.error.reason for r in RowStream([str(path)])]
    assert e.value.reason == "invalid_json"
    path.write_text('[{"i": 0}, 7]')
    assert [r.error and r.error.reason for r in RowStream([str(path)])] == [None, "not_an_object"]
