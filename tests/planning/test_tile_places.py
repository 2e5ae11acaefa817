"""The peak over the tile count place by place (``effpass/planning/places.py``, issue 39.5), on analytic place
profiles: two places that cross beyond the replayed counts (the peak's own extrapolation misses it, the places
do not), a middle tile's place affine in its index, the depth combination, and every refusal with its reason.

Oracles: numerical (the exact peak equals the maximum of the analytic places at ``n`` tiles, computed here
directly; the secant of the replayed peaks is below it), structural (the peak's phase and node, the number of
places, the reasons given when the places do not line up)."""
from array import array

from effpass.planning.places import _at_depth, exact_peak

COUNTS = (4, 5, 6)


def _profile(c, *, mid_slope=20, bent=0, drop_tile=None, extra=0):
    """A step's places at ``c`` tiles: a forward before the tiles (affine in ``c``), one region of ``c`` tiles in
    the backward (first, middle, last: 2 allocations each; a middle tile's first ``1000 + 5 c + mid_slope k``), the
    optimizer's eager code."""
    p = {("forward", "1", ("pre",)): (array("q", [100 + 10 * c, 400 + 20 * c + bent * c * c]), ["mm", "cat"])}
    for k in range(c):
        if k == drop_tile:
            continue
        vals = [1000 + 5 * c + mid_slope * k, 900 + 5 * c] if 0 < k < c - 1 else [1000 + 5 * c, 990 + 5 * c]
        more = extra if k == 1 else 0
        p[("backward", "1", (0, k))] = (array("q", vals + [0] * more), [f"add_{k}", f"mul_{k}"] + ["x"] * more)
    p[("backward", "eager", ("pre",))] = (array("q", [1200 + c]), ["eager code"])
    return p


def _truth(n, mid_slope=20, phase=None):
    """The largest place at ``n`` tiles (of ``phase``), from the formulas above."""
    fwd = [100 + 10 * n, 400 + 20 * n]
    bwd = [1000 + 5 * n, 990 + 5 * n, 1200 + n, 900 + 5 * n] + [1000 + 5 * n + mid_slope * k for k in range(1, n - 1)]
    return max({"forward": fwd, "backward": bwd, None: fwd + bwd}[phase])


def test_places_cross_beyond_the_replayed_counts_and_the_peak_follows():
    profs = [_profile(c) for c in COUNTS]
    peaks = [max(max(v) for v, _ in p.values()) for p in profs]
    assert peaks == [1204, 1205, 1206]  # the eager place at 4-6 tiles; the middle tiles' grows faster
    for n, node in ((7, "eager code"), (12, "add_1"), (54, "add_1")):
        got, why = _at_depth(profs, COUNTS, n)
        assert why == "" and got.step_peak == _truth(n), (n, got and got.step_peak, _truth(n))
        assert (got.phase, got.node) == ("backward", node)  # named in the last count's replay
        assert peaks[-1] + (n - 6) * (peaks[-1] - peaks[-2]) <= got.step_peak  # the secant: a lower bound
    assert _at_depth(profs, COUNTS, 54)[0].step_peak == 2310 > 1254  # the peak's own secant at 54 tiles
    # a middle tile's place falling with its index: its largest value at the second tile; the forward leads
    flat = [_profile(c, mid_slope=-1) for c in COUNTS]
    got, _ = _at_depth(flat, COUNTS, 54)
    assert (got.step_peak, got.phase, got.node) == (_truth(54, -1), "forward", "cat") == (1480, "forward", "cat")
    assert got.phase_peaks == {"forward": 1480, "backward": _truth(54, -1, "backward")} == {"forward": 1480,
                                                                                           "backward": 1270}
    assert got.places == 2 + 4 + 1 + 2 * 52  # forward, first and last tile, eager, 52 middle tiles


def test_places_that_do_not_line_up_are_refused_with_the_reason():
    bent = [_profile(c, bent=1) for c in COUNTS]
    got, why = _at_depth(bent, COUNTS, 54)
    assert got is None and why == "a place in the forward (cat) is not affine: 496 / 525 / 556"
    missing = [_profile(4), _profile(5, drop_tile=2), _profile(6)]
    assert "middle tiles are not all there" in _at_depth(missing, COUNTS, 54)[1]
    longer = [_profile(4), _profile(5, extra=1), _profile(6)]
    assert "allocate [2, 3] times" in _at_depth(longer, COUNTS, 54)[1]
    assert _at_depth([_profile(4), None, _profile(6)], COUNTS, 54) == (None, "the places were not recorded")


class _Est:
    def __init__(self, profs, depths=(2, 3, 4), target=32):
        self.depth_places, self.depths, self.depth_target = profs, list(depths), target


def test_each_phase_is_combined_over_depth_and_checked_affine():
    """Three depths: each phase's exact peak at ``n`` tiles extrapolated to 32 blocks (affine, checked); the
    step's peak is the largest phase's there."""
    def at(c, d):  # a block adds 400 to every forward place, 10 to every backward one
        p = _profile(c)
        for key, (v, names) in p.items():
            p[key] = (array("q", [x + (400 if key[0] == "forward" else 10) * d for x in v]), names)
        return p
    ests = [_Est([at(c, d) for d in (2, 3, 4)]) for c in COUNTS]
    got, why = exact_peak(ests, COUNTS, 54)
    fwd, bwd = _truth(54, phase="forward") + 400 * 32, _truth(54, phase="backward") + 10 * 32
    assert why == "" and got.phase_peaks == {"forward": fwd, "backward": bwd} == {"forward": 14280, "backward": 2630}
    assert (got.step_peak, got.phase, got.node) == (fwd, "forward", "cat")
    for e in ests:  # the third depth replayed with 5 blocks: not affine over depth
        e.depth_places[2] = at(6 if e is ests[2] else 4 + ests.index(e), 5)
    assert "not affine in depth" in exact_peak(ests, COUNTS, 54)[1]
