"""Comparing score tables (``retmask.heads.compare``) and the ``retmask compare`` command."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import pearsonr, rankdata, spearmanr

from retmask.commands import compare as compare_command
from retmask.heads import SelectionError
from retmask.heads.compare import average_ranks, compare_scores, format_comparison, pearson, spearman


def _table(matrix: np.ndarray) -> dict[tuple[int, int], float]:
    return {(ly, h): float(matrix[ly, h]) for ly in range(matrix.shape[0]) for h in range(matrix.shape[1])}


def _write(path, matrix: np.ndarray, per_test: int = 3) -> str:
    """A published-format file whose per-test lists average to ``matrix``."""
    raw = {
        f"{ly}-{h}": [float(matrix[ly, h])] * per_test
        for ly in range(matrix.shape[0])
        for h in range(matrix.shape[1])
    }
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("seed", range(5))
def test_rank_correlations_match_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    # Retrieval scores are mostly exact zeros and multiples of 1/answer length: many ties.
    a = rng.integers(0, 6, n) / 5.0 * (rng.random(n) < 0.4)
    b = np.clip(a + rng.normal(0, 0.1, n).round(1), 0, None)
    assert average_ranks(a) == pytest.approx(rankdata(a, method="average"))
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert pearson(a, b) == pytest.approx(pearsonr(a, b).statistic, abs=1e-12)


def test_constant_side_gives_nan_not_a_number():
    assert math.isnan(spearman(np.zeros(9), np.arange(9.0)))
    assert math.isnan(pearson(np.ones(4), np.arange(4.0)))


def test_compare_scores_sets_top_k_and_changes():
    base = np.zeros((3, 4))
    base[0, 1], base[1, 2], base[2, 3], base[2, 0] = 0.9, 0.5, 0.12, 0.05
    other = base.copy()
    other[2, 3] = 0.08  # drops below τ
    other[2, 0] = 0.3  # rises above τ
    other[1, 2] = 0.45  # stays above, moves 0.05
    cmp = compare_scores(_table(base), _table(other), labels=("fp32", "bf16"), tau=0.1, top_k=3, changes=2)
    assert cmp.grid == (3, 4) and cmp.heads_filled == (0, 0)
    assert cmp.tau_base == ((0, 1), (1, 2), (2, 3)) and cmp.tau_other == ((0, 1), (1, 2), (2, 0))
    assert cmp.tau_shared == ((0, 1), (1, 2)) and cmp.only_base == ((2, 3),) and cmp.only_other == ((2, 0),)
    assert cmp.jaccard == pytest.approx(2 / 4)
    assert cmp.top_overlap == 2  # top 3: {0-1, 1-2, 2-3} against {0-1, 1-2, 2-0}
    assert [h for h, _, _ in cmp.largest_changes] == [(2, 0), (1, 2)]
    assert cmp.largest_changes[0][1:] == pytest.approx((0.05, 0.3))
    assert cmp.max_abs_difference == pytest.approx(0.25)
    assert cmp.mean_abs_difference == pytest.approx((0.25 + 0.04 + 0.05) / 12)
    assert cmp.spearman == pytest.approx(spearmanr(base.ravel(), other.ravel()).statistic)
    data = cmp.to_json()
    assert data["only_base"] == ["2-3"] and data["only_other"] == ["2-0"] and not data["tau_sets_equal"]
    assert data["largest_changes"][0] == {
        "head": "2-0",
        "base": 0.05,
        "other": 0.3,
        "difference": pytest.approx(0.25),
    }
    text = " ".join(format_comparison(cmp).split())
    assert "only in fp32: 2-3" in text and "only in bf16: 2-0" in text and "top-3 overlap 2/3" in text
    assert "largest changes 2-0 0.050 -> 0.300, 1-2 0.500 -> 0.450" in text


def test_identical_tables_agree_fully():
    rng = np.random.default_rng(7)
    m = rng.random((5, 3)) * (rng.random((5, 3)) < 0.5)
    cmp = compare_scores(_table(m), _table(m))
    assert cmp.spearman == pytest.approx(1.0) and cmp.jaccard == 1.0 and cmp.largest_changes == ()
    assert cmp.top_overlap == cmp.top_k == 10 and cmp.max_abs_difference == 0.0
    assert "every head scores the same" in format_comparison(cmp)


def test_absent_heads_count_as_zero_and_are_reported():
    rng = np.random.default_rng(3)
    m = rng.random((4, 4))
    trimmed = {h: s for h, s in _table(m).items() if s >= 0.5}
    trimmed[(3, 3)] = float(m[3, 3])  # keep the grid's corner so both span 4 x 4
    cmp = compare_scores(_table(m), trimmed)
    assert cmp.heads_filled == (0, 16 - len(trimmed))
    assert "counted as 0 there" in format_comparison(cmp)
    full = {h: trimmed.get(h, 0.0) for h in _table(m)}
    assert cmp.spearman == pytest.approx(compare_scores(_table(m), full).spearman)


def test_different_models_refused():
    with pytest.raises(SelectionError, match="different models"):
        compare_scores(_table(np.ones((30, 9))), _table(np.ones((30, 8))))


def test_command_report_json_and_plot(tmp_path, capsys):
    rng = np.random.default_rng(11)
    base = rng.random((6, 3)) * 0.3
    other = np.abs(base + rng.normal(0, 0.02, base.shape))  # scores are >= 0: a negative one is refused
    third = rng.random((6, 3)) * 0.3
    files = [_write(tmp_path / n, m) for n, m in (("a.json", base), ("b.json", other), ("c.json", third))]
    out_json, out_png = tmp_path / "o" / "cmp.json", tmp_path / "o" / "cmp.png"
    rc = compare_command.main([*files, "--json", str(out_json), "--plot", str(out_png), "--top-k", "5"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "b.json against a.json" in printed and "c.json against a.json" in printed
    data = json.loads(out_json.read_text())
    assert [c["other"] for c in data["comparisons"]] == ["b.json", "c.json"]
    rho = spearmanr(base.ravel(), other.ravel()).statistic
    assert data["comparisons"][0]["spearman"] == pytest.approx(rho)
    assert data["comparisons"][0]["top_k"] == 5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_command_errors_name_the_problem(tmp_path, capsys):
    a = _write(tmp_path / "a.json", np.full((2, 2), 0.2))
    b = _write(tmp_path / "b.json", np.full((3, 2), 0.2))
    assert compare_command.main([a, str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert compare_command.main([a, b]) == 2
    assert "different models" in capsys.readouterr().err
    assert compare_command.main([a, a, "--labels", "only-one"]) == 2
    assert "--labels names 1 files but 2" in capsys.readouterr().err
    assert compare_command.main([a, a, "--labels", "x,"]) == 2
    assert "non-empty name" in capsys.readouterr().err
    assert compare_command.main([a, a, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_same_file_names_fall_back_to_paths(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = _write(tmp_path / "x" / "s.json", np.full((2, 2), 0.2))
    b = _write(tmp_path / "y" / "s.json", np.full((2, 2), 0.3))
    assert compare_command.main([a, b]) == 0
    assert f"{b} against {a}" in capsys.readouterr().out


def test_command_imports_no_torch(tmp_path):
    a = _write(tmp_path / "a.json", np.eye(3))
    b = _write(tmp_path / "b.json", np.eye(3) * 0.5)
    code = (
        "import sys; from retmask.cli import main; rc = main(['compare', sys.argv[1], sys.argv[2]]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code, a, b], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "b.json against a.json" in done.stdout


def test_command_defaults_are_the_library_defaults():
    import argparse
    import inspect

    parser = argparse.ArgumentParser()
    compare_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["compare", "a.json", "b.json"])
    defaults = {n: p.default for n, p in inspect.signature(compare_scores).parameters.items()}
    assert (args.tau, args.top_k, args.changes) == (defaults["tau"], defaults["top_k"], defaults["changes"])
