"""The per-commit sample of the sweeps (tests/_sweep.py): the anchor always, a fraction of the others by the seed, a
``FULL_ONLY`` case never drawn but kept by the full run."""
import _sweep


def _ids(names, test="x"):
    return [f"tests/t.py::test_{test}[{n}]" for n in names]


def test_the_sample_keeps_the_anchor_draws_a_fraction_and_never_a_full_only_case(monkeypatch):
    names = ["llama", "kimi_linear", *(f"f{i}" for i in range(30))]
    cases = _ids(names) + _ids(["kimi_linear-bf16", "kimi_linear-fp16", "gpt2-bf16"], "y")
    drawn = set()
    for seed in ("a", "b", "c", "d", "e", "f"):
        monkeypatch.setattr(_sweep, "SWEEP_SEED", seed)
        got = _sweep.sample(cases)
        assert got[0] == cases[0] and got == [c for c in cases if c in got]          # the anchor, in order
        assert len(got) == 1 + round((len(cases) - 4) / 3)                            # a third of the drawable
        assert not [c for c in got if "kimi_linear" in c]
        assert _sweep.sample(cases) == got                                            # one seed: one sample
        drawn |= set(got)
    assert len(drawn) > len(got)                                                      # seeds rotate the rest
    monkeypatch.setattr(_sweep, "SWEEP_SEED", None)
    assert _sweep.sample(cases) == cases                                              # the full run: all
    assert all(len(why) > 40 for why in _sweep.FULL_ONLY.values())
    # an anchor is kept even when it is FULL_ONLY (a sweep always runs its first case)
    monkeypatch.setattr(_sweep, "SWEEP_SEED", "a")
    assert _sweep.sample(_ids(["kimi_linear", "llama"]))[0].endswith("[kimi_linear]")
