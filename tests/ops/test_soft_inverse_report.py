"""tools/soft_inverse_report.py end to end on small matrices: the facts docs/MIXERS.md#soft rests on."""
import json


def test_report_compares_both_inverses_at_each_condition(tmp_path, load_tool):
    soft_inverse_report = load_tool("soft_inverse_report")
    soft_inverse_report.main(["--landmarks", "9", "--dim", "4", "--iters", "20", "--out", str(tmp_path / "r")])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {(row["condition"], row["inverse"].split()[0]) for row in rows} == {
        (c, name) for c in soft_inverse_report.CONDITIONS for name in ("ours", "released")}
    for row in rows:
        assert abs(row["measured_condition"] / row["condition"] - 1) < 0.05
    by = {(row["condition"], row["inverse"].split()[0]): row for row in rows}
    assert by[1.0, "ours"]["error_vs_its_target"] < 1e-12 and by[1.0, "ours"]["backward_cosine"] > 0.999
    # at A = I the released step 2/(max row sum)² sits on the edge of convergence: the iterate collapses to 0
    assert by[1.0, "released"]["error_vs_exact_inverse"] > 0.5
    assert "| cond(A) | steps |" in (tmp_path / "r.md").read_text()
