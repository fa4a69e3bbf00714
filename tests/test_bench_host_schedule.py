"""bench/host_schedule.py runs the scheduler it times (the timings are the script's output, not checked here)."""

import json
from pathlib import Path


def test_rows_per_batch_and_block_size(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import host_schedule

    host_schedule.main(["--batch", "3,5", "--block-size", "4,16", "--steps", "5", "--rounds", "1",
                        "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "host_schedule.json").read_text())["rows"]
    assert [(r["batch"], r["block_size"]) for r in rows] == [(3, 4), (3, 16), (5, 4), (5, 16)]
    assert all(r["ms_per_step"] > 0 and r["us_per_sequence"] == r["ms_per_step"] * 1e3 / r["batch"] for r in rows)
