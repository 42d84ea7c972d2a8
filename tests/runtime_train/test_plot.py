# metrics.png from metrics.jsonl: the records a running or resumed run leaves (a half-written last line, a step
# logged again after a resume) draw without complaint; a directory with no metrics is one error line.
import json

from runtime.plot import _series, main, plot_run, read_metrics


def test_a_resumed_run_with_a_half_written_line_draws(tmp_path):
    rows = [{"step": s, "loss": 8 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 9000.0} for s in range(1, 11)]
    rows += [{"step": 10, "val_loss": 7.5}, {"step": 8, "loss": 7.0, "lr": 1e-3, "tokens_per_s": 8000.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert len(read_metrics(tmp_path)) == len(rows)
    steps, losses = _series(read_metrics(tmp_path), "loss")
    assert steps == list(range(1, 11)) and losses[7] == 7.0  # step 8 as logged after the resume
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_no_metrics_is_one_error_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no metrics.jsonl in"), err
