# Reshard on resume: a checkpoint saved under one tp x pp x dp (x ZeRO-1) layout resumes under others with no
# offline step, and the next step's loss equals the un-resharded continuation's (fp32, 4 gloo processes).
import pytest

from tests.checkpoint import harness as CH
from tests.runtime_parallel.dist_utils import run_distributed

L = CH.L
CASES = {
    # The case: tp=2 x dp=2 with ZeRO-1 resumed at tp=1 x dp=4 and tp=4 x dp=1, plus pipeline layouts.
    # Context parallelism (cp 4 with ZeRO-1 over all 4 dp ranks; cp 2 x tp 2) takes the same checkpoint.
    "from_tp2_dp2_zero1": (L(tp=2, zero1=True), [L(tp=1), L(tp=4), L(tp=1, pp=2, zero1=True), L(tp=2, pp=2),
                                                 L(tp=1, cp=4, zero1=True)]),
    # Saved by a pipeline (a tied embedding split over the first and last stage), resumed without one.
    "from_tp2_pp2": (L(tp=2, pp=2), [L(tp=1, zero1=True), L(tp=1, pp=4), L(tp=2, cp=2)]),
    # Uneven stages placed by model.pipeline_cuts (1, 3, 2 and 1 of 7 layers), resumed under the even split and
    # without a pipeline.
    "from_pp4_cuts": (L(pp=4, cuts=(0, 3, 5), num_layers=7),
                      [L(pp=4, num_layers=7), L(tp=2, pp=2, num_layers=7), L(tp=1, zero1=True, num_layers=7)]),
}
# Mixtral saved with its experts split over EP and TP (ZeRO-1 over the expert-data-parallel group), resumed with
# the experts whole, over 4 EP ranks, in a pipeline, and split by TP alone.
MOE_CASES = {
    "from_ep2_tp2_zero1": (L(tp=2, ep=2, zero1=True), [L(tp=1), L(tp=1, ep=4, zero1=True), L(tp=1, pp=2, ep=2),
                                                     L(tp=2)]),
}
CASES.update(MOE_CASES)
PARAMS = [(arch, case) for arch in ("gpt", "llama") for case in CASES if case not in MOE_CASES]
PARAMS += [("mixtral", case) for case in MOE_CASES]


@pytest.fixture(scope="module", params=PARAMS,
                ids=lambda p: f"{p[0]}-{p[1]}")
def results(request, tmp_path_factory):
    arch, case = request.param
    saved, targets = CASES[case]
    directory = str(tmp_path_factory.mktemp("ckpt"))
    ranks = run_distributed(CH.suite, world_size=4, args=(arch, saved, targets, directory))
    return arch, saved, targets, ranks


def test_next_loss_matches_unresharded_continuation(results):
    arch, saved, targets, ranks = results
    expected = ranks[0]["saved"]["next_loss"]
    for target in targets:
        for rank in ranks:
            got = rank[str(target)]["next_loss"]
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (arch, str(saved), str(target))


def test_loaded_weights_are_identical_across_layouts(results):
    _, _, targets, ranks = results
    first = ranks[0][str(targets[0])]["loaded"]
    for target in targets[1:]:
        other = ranks[0][str(target)]["loaded"]
        for name in set(first) & set(other):
            assert (first[name] == other[name]).all(), (str(target), name)


def test_step_and_extra_state_come_back(results):
    _, _, targets, ranks = results
    for target in targets:
        assert all(rank[str(target)]["optimizer_step"] == CH.STEPS for rank in ranks)
        assert all(rank[str(target)]["extra"] == {"step": CH.STEPS} for rank in ranks)
