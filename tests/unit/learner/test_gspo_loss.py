"""GSPO (``learner.gspo.gspo_policy_loss``) against the paper's formula in plain Python.

The reference computes, per sequence i with trained tokens T_i (n_i of them),
s_i = exp(mean_{T_i} (log π_θ − log π_old)), the clipped objective
max(−A·s_i, −A·clip(s_i)) (dual clip for A < 0) times the token's weight w, the
behaviour bound on ρ_i = exp(mean_{T_i} (log π_θ − log π_behav)), then the mean
over sequences of the mean over T_i. Its gradient with respect to log π_θ(y_t)
is written out from the paper (−A·w·s_i / (n_i·S) where the unclipped term is
the active one, 0 elsewhere) and, for one advantage per sequence, also taken by
finite differences of the reference objective itself: with s_i a function of
every token, not stop-gradiented, GSPO-token's gradient must equal it.
"""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.config import ConfigError, convert
from learner.algorithms import gspo_policy_loss, policy_loss
from learner.config import LearnerConfig

NEG = -1e30  # a masked token may carry anything


def seq_ratio(row_lp, row_ref, row_mask):
    trained = [t for t, m in enumerate(row_mask) if m]
    if not trained:
        return 1.0, 0
    mean = sum(row_lp[t] - row_ref[t] for t in trained) / len(trained)
    return math.exp(max(-20.0, min(20.0, mean))), len(trained)


def reference(lp, old, adv, mask, *, low, high, c=None, weights=None, behavior=None, seqs=None):
    """Plain Python: (loss, d loss / d lp) from the paper's formula."""
    present = [i for i, row in enumerate(mask) if any(row)]
    count = seqs if seqs is not None else max(len(present), 1)
    loss, grad = 0.0, [[0.0] * len(row) for row in lp]
    for i in present:
        s, n = seq_ratio(lp[i], old[i], mask[i])
        rho = seq_ratio(lp[i], behavior[i], mask[i])[0] if behavior is not None else None
        for t, m in enumerate(mask[i]):
            if not m:
                continue
            a = adv[i][t]
            w = 1.0 if weights is None else weights[i][t]
            unclipped, clipped = -a * s, -a * min(max(s, 1 - low), 1 + high)
            token, slope = max(unclipped, clipped), (0.0 if clipped > unclipped else -a * s)
            if c is not None and a < 0 and token > -c * a:
                token, slope = -c * a, 0.0
            token, slope = token * w, slope * w
            if rho is not None and w > 0:
                past = (a > 0 and rho > 1 + high) or (a < 0 and rho < 1 - low)
                bound = -a * min(max(rho, 1 - low), 1 + high)
                if past and bound > token:
                    token, slope = bound, 0.0
            loss += token / n / count
            grad[i][t] = slope / n / count
    return loss, grad


def run(
    lp,
    old,
    adv,
    mask,
    *,
    low=0.2,
    high=0.2,
    c=None,
    weights=None,
    behavior=None,
    seqs=None,
    dp_size=1,
):
    """``gspo_policy_loss`` on float64 tensors, arguments named as ``reference``'s."""
    to = lambda x: None if x is None else torch.tensor(x, dtype=torch.float64)  # noqa: E731
    logprob = to(lp).requires_grad_()
    loss, metrics = gspo_policy_loss(
        logprob, to(old), to(adv), to(mask), clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=c, is_weights=to(weights), behavior_logprob=to(behavior),
        global_seq_count=seqs, dp_size=dp_size,
    )  # fmt: skip
    loss.backward()
    return loss.item(), logprob.grad.tolist(), metrics


# Three sequences of lengths 4, 2, 3 padded to 5; sequence 0 has a tool token at t=1.
MASK = [[1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
OLD = [[-1.0, -2.0, -0.5, -1.5, 0.0], [-0.7, -0.2, 0.0, 0.0, 0.0], [-1.1, -0.9, -2.0, 0.0, 0.0]]


def shifted(deltas):
    """log π_θ = log π_old + delta on each row's trained tokens; extreme values elsewhere."""
    return [
        [o + d if m else NEG for o, d, m in zip(row_old, row_d, row_m, strict=True)]
        for row_old, row_d, row_m in zip(OLD, deltas, MASK, strict=True)
    ]


def masked_filled(rows, value):
    """``rows`` with ``value`` on every position outside ``MASK``."""
    return [
        [x if m else value for x, m in zip(row, row_mask, strict=True)]
        for row, row_mask in zip(rows, MASK, strict=True)
    ]


def per_sequence(values):
    return [[v] * 5 for v in values]


CASES = {
    # s_i = e^0.01, e^-0.02, e^0.003: inside a wide range, every sequence trains
    "unclipped, per-sequence advantages": dict(
        deltas=[[0.02, 9.0, 0.0, 0.01, 0], [-0.03, -0.01, 0, 0, 0], [0.0, 0.003, 0.006, 0, 0]],
        adv=per_sequence([1.0, -0.5, 2.0]),
        low=0.2,
        high=0.2,
    ),
    # GSPO ranges: seq 0 (A > 0, s > 1 + 4e-4) and seq 1 (A < 0, s < 1 − 3e-4) clipped;
    # seq 2 (A > 0, s < 1) is on the side where the clip does not bind
    "clipped on both sides": dict(
        deltas=[[0.01, 0, 0.0, 0.002, 0], [-0.01, -0.002, 0, 0, 0], [-0.01, 0.0, -0.002, 0, 0]],
        adv=per_sequence([1.0, -1.0, 0.7]),
        low=3e-4,
        high=4e-4,
    ),
    # the other sides: A < 0 with s > 1 + ε (unbounded but for the dual clip), A > 0 with s < 1 − ε
    "non-binding sides and the dual clip": dict(
        deltas=[[0.01, 0, 0.01, 0.01, 0], [-0.5, -0.5, 0, 0, 0], [1.5, 1.5, 1.5, 0, 0]],
        adv=per_sequence([-1.0, 2.0, -0.3]),
        low=3e-4,
        high=4e-4,
        c=3.0,
    ),
    # per-token advantages (GAE-like): the clip decision is per token on the sequence ratio
    "per-token advantages": dict(
        deltas=[[0.01, 0, 0.0, 0.002, 0], [-0.01, -0.002, 0, 0, 0], [0.0, 0.0, 0.0, 0, 0]],
        adv=[[1.0, 0, -0.5, 0.3, 0], [-1.0, 0.4, 0, 0, 0], [0.2, -0.2, 0.9, 0, 0]],
        low=3e-4,
        high=4e-4,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_match_the_paper_formula(name):
    case = dict(CASES[name])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    loss, grad, metrics = run(lp, OLD, adv, MASK, **case)
    want_loss, want_grad = reference(lp, OLD, adv, MASK, **case)
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    for got_row, want_row in zip(grad, want_grad, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-10, abs=1e-15)
    ratios = [seq_ratio(lp[i], OLD[i], MASK[i])[0] for i in range(3)]
    assert metrics["seq_ratio_mean"].item() == pytest.approx(sum(ratios) / 3)
    assert metrics["seq_ratio_abs_dev"].item() == pytest.approx(sum(abs(r - 1) for r in ratios) / 3)


def test_clip_metrics_count_whole_sequences_in_tokens():
    case = dict(CASES["clipped on both sides"])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    _, grad, metrics = run(lp, OLD, adv, MASK, **case)
    # sequences 0 (3 tokens) and 1 (2 tokens) clipped, sequence 2 (3 tokens) not
    assert metrics["pg_clipfrac"].item() == pytest.approx(5 / 8)
    assert grad[0] == [0.0] * 5 and grad[1] == [0.0] * 5
    assert all(g != 0 for g, m in zip(grad[2], MASK[2], strict=True) if m)
    case = dict(CASES["non-binding sides and the dual clip"])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    _, grad, metrics = run(lp, OLD, adv, MASK, **case)
    # s_2 = e^1.5 > c = 3 with A < 0: the dual clip holds its 3 tokens; nothing else clips
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(3 / 8)
    assert metrics["pg_clipfrac"].item() == 0.0
    assert grad[2] == [0.0] * 5


@pytest.mark.parametrize("name", ["unclipped, per-sequence advantages", "clipped on both sides"])
def test_gradient_is_the_finite_difference_of_the_sequence_objective(name):
    """One advantage per sequence: GSPO-token's stop-gradients give GSPO's true gradient."""
    case = dict(CASES[name])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    _, grad, _ = run(lp, OLD, adv, MASK, **case)
    step = 1e-7
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if not m:
                continue
            up = [r[:] for r in lp]
            down = [r[:] for r in lp]
            up[i][t] += step
            down[i][t] -= step
            numeric = (
                reference(up, OLD, adv, MASK, **case)[0]
                - reference(down, OLD, adv, MASK, **case)[0]
            ) / (2 * step)
            assert grad[i][t] == pytest.approx(numeric, rel=1e-5, abs=1e-9), (i, t)


def test_decoupled_composition_weights_and_sequence_behaviour_bound():
    """Ratio against π_prox, w = π_prox/π_behav per token, trust region on ρ_i per sequence."""
    deltas = [[0.0001, 0, 0.0, 0.0002, 0], [0.0, 0.0, 0, 0, 0], [0.0, 0.0001, 0.0, 0, 0]]
    lp = shifted(deltas)  # π_θ ≈ π_prox: every s_i inside [1 − 3e-4, 1 + 4e-4]
    # behaviour: seq 0 drifted down (ρ_0 > 1 + ε with A > 0: past), seq 1 drifted up
    # (ρ_1 < 1 − ε with A < 0: past), seq 2 equal to π_prox (inside)
    behavior = [
        [o - 0.01 for o in OLD[0]],
        [o + 0.01 for o in OLD[1]],
        [o for o in OLD[2]],
    ]
    weights = [[1.3, 0, 0.0, 1.1, 0], [0.9, 0.8, 0, 0, 0], [1.0, 2.0, 0.5, 0, 0]]
    adv = per_sequence([1.0, -1.0, 0.5])
    kwargs = dict(low=3e-4, high=4e-4, c=3.0, weights=weights, behavior=behavior)
    loss, grad, metrics = run(lp, OLD, adv, MASK, **kwargs)
    want_loss, want_grad = reference(lp, OLD, adv, MASK, **kwargs)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for got_row, want_row in zip(grad, want_grad, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-10, abs=1e-15)
    # seq 0: t0, t3 past (w > 0), t2 has w = 0 (stays out); seq 1: both tokens past
    assert metrics["pg_clipfrac_behavior"].item() == pytest.approx(4 / 8)
    assert grad[0] == [0.0] * 5 and grad[1] == [0.0] * 5
    # sequence 2 trains with its tokens' own weights: −A·w·s / (n·S)
    s2 = seq_ratio(lp[2], OLD[2], MASK[2])[0]
    assert grad[2][:3] == pytest.approx([-0.5 * w * s2 / 3 / 3 for w in weights[2][:3]])


def run_both(lp, old, adv, mask, agg, **kwargs):
    tensors = [torch.tensor(x, dtype=torch.float64) for x in (lp, old, adv, mask)]
    outs = []
    for fn in ("gspo", "vanilla"):
        logprob = tensors[0].clone().requires_grad_()
        common = (logprob, tensors[1], tensors[2], tensors[3])
        if fn == "gspo":
            loss, metrics = gspo_policy_loss(*common, **kwargs)
        else:
            loss, metrics = policy_loss(*common, loss_agg_mode=agg, **kwargs)
        loss.backward()
        outs.append((loss, logprob.grad, metrics))
    return outs


def test_single_token_sequences_equal_vanilla_ppo_with_corrections():
    """One token per sequence: s_i = r_t and seq-mean-token-mean = token-mean."""
    lp = [[-1.0], [-0.2], [-3.0], [-0.5], [-2.0]]
    old = [[-1.3], [-0.2], [-2.0], [-0.51], [-2.5]]
    adv = [[1.0], [-1.0], [-2.0], [0.5], [1.5]]
    mask = [[1], [1], [1], [1], [1]]
    weights = torch.tensor([[1.2], [0.7], [1.0], [0.0], [2.0]], dtype=torch.float64)
    behavior = torch.tensor([[-1.5], [0.0], [-2.2], [-0.3], [-2.0]], dtype=torch.float64)
    for kwargs in (
        dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
        dict(
            clip_ratio_low=0.2, clip_ratio_high=0.2, is_weights=weights, behavior_logprob=behavior
        ),
    ):
        (g_loss, g_grad, g_m), (v_loss, v_grad, v_m) = run_both(
            lp, old, adv, mask, "token-mean", **kwargs
        )
        torch.testing.assert_close(g_loss, v_loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g_grad, v_grad, rtol=1e-12, atol=1e-15)
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "pg_clipfrac_behavior", "ppo_kl"):
            torch.testing.assert_close(g_m[key], v_m[key], msg=key)
        assert v_m["pg_clipfrac"] > 0  # not vacuous: the clips are active in both


def test_on_policy_gspo_equals_vanilla_seq_mean_token_mean():
    """π_θ = π_old: s_i = r_t = 1 and both gradients are −A·w·∇log π_θ per token."""
    lp = masked_filled(OLD, NEG)
    adv = [[1.0, 0, -0.5, 0.3, 0], [-1.0, 0.4, 0, 0, 0], [0.2, -0.2, 0.9, 0, 0]]
    weights = torch.tensor([[1.3, 0, 0.0, 1.1, 0], [0.9, 0.8, 0, 0, 0], [1.0, 2.0, 0.5, 0, 0]])
    (g_loss, g_grad, _), (v_loss, v_grad, _) = run_both(
        lp, OLD, adv, MASK, "seq-mean-token-mean", is_weights=weights.double(),
        global_seq_count=4, dp_size=2,
    )  # fmt: skip
    torch.testing.assert_close(g_loss, v_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_grad, v_grad, rtol=1e-12, atol=1e-15)
    assert g_grad.abs().sum() > 0


def test_masked_tokens_with_extreme_values_change_nothing_and_give_no_nan():
    case = dict(CASES["clipped on both sides"])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    benign, hostile = masked_filled(lp, -1.0), masked_filled(lp, -math.inf)
    hostile_old = masked_filled(OLD, math.inf)
    behavior, hostile_behavior = masked_filled(OLD, 0.0), masked_filled(OLD, math.nan)
    weights = [[1.0] * 5 for _ in MASK]
    calm = run(benign, OLD, adv, MASK, weights=weights, behavior=behavior, **case)
    wild = run(hostile, hostile_old, adv, MASK, weights=weights, behavior=hostile_behavior, **case)
    assert math.isfinite(wild[0]) and wild[0] == calm[0]
    assert wild[1] == calm[1]
    for key, value in wild[2].items():
        assert torch.isfinite(value), key
        assert value.item() == calm[2][key].item(), key


def test_a_sequence_without_trained_tokens_contributes_nothing():
    mask = [[1, 1, 0], [0, 0, 0]]
    old = [[-1.0, -0.5, 0.0], [-1.0, -1.0, -1.0]]
    lp = [[-0.9, -0.5, 0.0], [5.0, -math.inf, 3.0]]
    adv = [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    loss, grad, metrics = run(lp, old, adv, mask)
    want_loss, want_grad = reference(lp, old, adv, mask, low=0.2, high=0.2)
    assert loss == pytest.approx(want_loss)  # the mean is over one sequence, not two
    assert grad[0][:2] == pytest.approx(want_grad[0][:2]) and grad[1] == [0.0] * 3
    assert metrics["seq_ratio_mean"].item() == pytest.approx(math.exp(0.05))
    empty = run([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[0, 0]])
    assert empty[0] == 0.0 and empty[1] == [[0.0, 0.0]]
    assert all(torch.isfinite(v) for v in empty[2].values())


def test_global_sequence_count_and_dp_size_scale_the_loss():
    case = dict(CASES["unclipped, per-sequence advantages"])
    lp, adv = shifted(case.pop("deltas")), case.pop("adv")
    loss, grad, _ = run(lp, OLD, adv, MASK, seqs=6, dp_size=2, **case)
    want_loss, want_grad = reference(lp, OLD, adv, MASK, **case, seqs=6)
    assert loss == pytest.approx(2 * want_loss)
    assert grad[0] == pytest.approx([2 * g for g in want_grad[0]])


def test_bad_arguments_are_refused_with_their_names():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages shape"):
        gspo_policy_loss(x, x, torch.zeros(2, 2), x)
    with pytest.raises(ValueError, match="clip ratios"):
        gspo_policy_loss(x, x, x, x, clip_ratio_low=-0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        gspo_policy_loss(x, x, x, x, clip_ratio_c=1.0)


def test_config_accepts_the_loss_modes_and_names_the_field_of_an_unknown_one():
    assert convert(LearnerConfig, {}).policy_loss.loss_mode == "vanilla"
    cfg = convert(LearnerConfig, {"policy_loss": {"loss_mode": "gspo"}})
    assert cfg.policy_loss.loss_mode == "gspo"
    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode"):
        convert(LearnerConfig, {"policy_loss": {"loss_mode": "gmpo"}})
