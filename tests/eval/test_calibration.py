"""Calibration of predicted acceptance (eval/calibration.py): ECE over equal-width bins and
the reliability diagram."""

import json

import pytest
import torch

from specdistill.eval.calibration import calibration, reliability_diagram


def test_a_perfectly_calibrated_set_has_ece_zero():
    g = torch.Generator().manual_seed(0)
    pred = torch.rand(5000, generator=g)
    report = calibration(pred, pred.clone())  # soft labels equal to the predictions
    assert report.n == 5000 and report.ece < 1e-12
    assert len(report.bins) == 10 and sum(b.count for b in report.bins) == 5000
    # 0/1 outcomes drawn with the predicted probabilities: ECE is sampling noise only
    outcome = torch.bernoulli(pred.expand(40, -1), generator=g)
    sampled = calibration(pred.expand(40, -1), outcome)
    assert sampled.ece < 0.01


def test_a_shifted_set_has_ece_equal_to_the_shift():
    g = torch.Generator().manual_seed(1)
    pred = 0.2 + 0.8 * torch.rand(3000, generator=g, dtype=torch.float64)
    report = calibration(pred, pred - 0.15)
    assert report.ece == pytest.approx(0.15, abs=1e-9)
    for b in report.bins:
        if b.count:
            assert b.lower <= b.mean_predicted <= b.upper
            assert b.mean_predicted - b.mean_realised == pytest.approx(0.15, abs=1e-9)
        else:
            assert b.mean_predicted is None and b.mean_realised is None
    assert report.bins[0].count == report.bins[1].count == 0


def test_bins_mask_and_edges():
    pred = torch.tensor([[0.0, 0.05, 0.5], [0.95, 1.0, 0.3]])
    label = torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    report = calibration(pred, label, mask, bins=4)
    assert report.n == 5
    assert [b.count for b in report.bins] == [2, 0, 1, 2]  # 1.0 falls in the last bin
    assert report.bins[0].mean_predicted == pytest.approx(0.025)
    assert report.bins[0].mean_realised == pytest.approx(0.5)
    # ECE = (2/5)·|0.025 − 0.5| + (1/5)·0 + (2/5)·|0.975 − 1|
    assert report.ece == pytest.approx(0.4 * 0.475 + 0.4 * 0.025)
    assert json.loads(json.dumps(report.to_dict()))["bins"][1]["mean_predicted"] is None
    empty = calibration(pred, label, torch.zeros_like(mask))
    assert empty.n == 0 and empty.ece is None


def test_probabilities_outside_0_1_are_refused():
    with pytest.raises(ValueError, match="pass probabilities, not logits"):
        calibration(torch.tensor([0.5, 2.0]), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="label values outside"):
        calibration(torch.tensor([0.5, 0.2]), torch.tensor([0.5, float("nan")]))


def test_the_reliability_diagram_is_written(tmp_path):
    g = torch.Generator().manual_seed(2)
    pred = torch.rand(500, generator=g)
    path = reliability_diagram(calibration(pred, pred * 0.9), tmp_path / "plots" / "rel.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    empty = calibration(pred[:0], pred[:0])
    assert reliability_diagram(empty, tmp_path / "empty.png", title="no data").is_file()
