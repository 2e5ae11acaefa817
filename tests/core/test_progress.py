"""Progress bars: shown on a terminal or when forced, silent otherwise (logs, CI)."""
import io
import sys

from effpass.progress import progress


def test_silent_when_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("EFFPASS_PROGRESS", raising=False)
    bar = progress(3, "work")
    for _ in range(3):
        bar.update()
    bar.close()
    assert capsys.readouterr().err == ""


def test_shown_when_forced(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    monkeypatch.setenv("EFFPASS_PROGRESS", "1")
    bar = progress(2, "effpass plan")
    bar.set_postfix_str("candidate 1")
    bar.update(2)
    bar.close()
    out = buf.getvalue()
    assert "effpass plan" in out and "/2" in out and "candidate 1" in out
    monkeypatch.setenv("EFFPASS_PROGRESS", "0")
    assert type(progress(2, "x")).__name__ == "_Quiet"
