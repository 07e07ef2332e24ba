"""The run folder's loss_curve.svg: valid SVG, the right series, log scale only for positive losses."""

import json
import xml.etree.ElementTree as ET

from trainstack._train.losscurve import MAX_POINTS, loss_series, render_svg, save_loss_curve

NS = "{http://www.w3.org/2000/svg}"


def _rows():
    rows = [{"epoch": 0, "step": s, "loss": 2.0 / s, "lr": 0.1} for s in range(1, 41)]
    rows += [{"epoch": e, "step": 10 * e, "train_loss": 1.5 / e, "val_loss": 1.7 / e, "val_acc": 0.5}
             for e in (1, 2, 3, 4)]
    return rows


def test_every_loss_series_is_drawn_against_the_step(tmp_path):
    path = save_loss_curve(_rows(), tmp_path / "loss_curve.svg")
    root = ET.parse(path).getroot()  # well-formed XML
    lines = root.findall(f"{NS}polyline")
    assert len(lines) == 3  # loss, train_loss, val_loss; never lr or val_acc
    legend = [t.text for t in root.findall(f"{NS}text")]
    assert {"loss", "train_loss", "val_loss"} <= set(legend) and "loss (log)" in legend
    xs = [float(p.split(",")[0]) for p in lines[0].get("points").split()]
    assert xs == sorted(xs) and len(xs) == 40  # one point per row, in step order
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically


def test_negative_losses_use_a_linear_axis_and_bad_values_are_skipped():
    rows = [{"step": s, "loss": v} for s, v in enumerate([0.5, -0.25, float("nan"), float("inf"), 0.1], 1)]
    series = loss_series(rows)
    assert series == {"loss": [(1.0, 0.5), (2.0, -0.25), (5.0, 0.1)]}
    svg = render_svg(series)
    assert "loss (log)" not in svg and ">loss<" in svg


def test_a_single_point_a_long_history_and_hostile_names(tmp_path):
    assert save_loss_curve([{"step": 1, "acc": 0.5}], tmp_path / "none.svg") is None  # no loss: no file
    assert not (tmp_path / "none.svg").exists()
    one = ET.fromstring(render_svg(loss_series([{"step": 3, "loss": 1.0}])))
    assert one.findall(f"{NS}circle")
    long = loss_series([{"step": s, "loss": 1.0 + s} for s in range(1, 10 * MAX_POINTS)])
    assert len(long["loss"]) <= MAX_POINTS
    hostile = render_svg(loss_series([{"step": 1, "<b>&_loss": 1.0}]))
    assert "&lt;b&gt;&amp;_loss" in ET.tostring(ET.fromstring(hostile), encoding="unicode")
    json.dumps(long)  # plain data
