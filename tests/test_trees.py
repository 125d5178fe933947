"""Draft trees: builders, lossless greedy and exact sampled verification, Medusa."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import tree
import mlx_spec.sampling as sampling
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.base import Draft, HostDrafter
from mlx_spec.drafters.medusa import Medusa, MedusaHeads
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams, log_probs
from stats import N, STAT_PROMPT, V, empirical_tv, told_apart, exact_joint, tiny, tokens_of, tv_bound

GREEDY = SamplingParams()


# --- builders ------------------------------------------------------------------



def cartesian(topk: list[int]) -> list[list[int]]:
    """Paths of the full tree with `topk[d]` children per node at depth d + 1."""
    paths = []
    for depth in range(1, len(topk) + 1):
        paths.extend(list(p) for p in itertools.product(*(range(k) for k in topk[:depth])))
    return paths

def test_medusa_default_tree():
    parents, depth, rank = tree.from_paths(tree.MC_SIM_7B_63)
    assert len(parents) == 63
    assert [depth.count(d) for d in (1, 2, 3, 4)] == [10, 28, 23, 2]
    assert all(p < i for i, p in enumerate(parents))
    # Each node's path, read back through its parents, is one of the given paths.
    for i in range(63):
        path = [rank[j] for j in tree.path_to(parents, i)]
        assert path in tree.MC_SIM_7B_63


def test_from_paths_needs_every_prefix():
    with pytest.raises(ValueError, match="no parent"):
        tree.from_paths([[0], [1, 0]])


def test_cartesian():
    paths = cartesian([3, 2])
    assert len(paths) == 3 + 6
    parents, depth, _ = tree.from_paths(paths)
    assert tree.children(parents)[-1] == [0, 1, 2] and depth.count(2) == 6


def test_best_first_is_the_top_budget_paths():
    rng = np.random.default_rng(0)
    scores = np.sort(np.log(rng.dirichlet(np.ones(4), size=3)), axis=1)[:, ::-1]  # [D, k] descending
    every = cartesian([4, 4, 4])
    total = {tuple(p): sum(scores[d, r] for d, r in enumerate(p)) for p in every}
    for budget in (1, 5, 20, 84):
        got = tree.best_first(scores, budget)
        best = sorted(total.values(), reverse=True)[:budget]
        assert sorted((total[tuple(p)] for p in got), reverse=True) == pytest.approx(best)
        tree.from_paths(got)  # a tree: every prefix is there


def test_top_nodes_keeps_ancestors():
    parents = [-1, -1, 0, 0, 2, 1]
    scores = [-0.1, -0.5, -0.5, -2.0, -0.6, -0.5]  # node 5 ties its parent 1
    for budget in range(1, 7):
        keep = tree.top_nodes(parents, scores, budget)
        assert len(keep) == budget
        tree.subtree(parents, keep)  # raises when a parent is missing
    assert tree.top_nodes(parents, scores, 3) == [0, 1, 2]


def test_truncate_and_subtree():
    parents = [-1, 0, 1, -1, 3]
    keep = tree.truncate(parents, 2)
    assert keep == [0, 1, 3, 4] and tree.subtree(parents, keep) == [-1, 0, -1, 2]
    assert tree.depths(parents) == [1, 2, 3, 1, 2]
    with pytest.raises(ValueError):
        tree.depths([0])


# --- lossless greedy -------------------------------------------------------------

SHAPES = {
    "single-path": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
    "deep": [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    "wide": [[r] for r in range(8)] + [[r, 0] for r in range(3)],
    "medusa": tree.MC_SIM_7B_63,
}


class ScriptedTree(HostDrafter):
    """A tree of a given shape whose nodes follow a known continuation or not.

    Each round picks, per depth, which rank carries the true token (or none),
    so the accepted path ends anywhere in the tree."""

    def __init__(self, truth, paths, vocab, seed):
        super().__init__()
        self.truth, self.vocab = truth, vocab
        self.parents, self.depth, self.rank = tree.from_paths(paths)
        self.rng = np.random.default_rng(seed)

    def restart(self, b, prompt, cached=0):
        self.states[b] = len(prompt)
        return cached

    def _session(self):
        return self

    def propose_row(self, b, context, k, params):
        start = len(context) - self.states[b]
        width = max(self.rank) + 1
        good = self.rng.integers(0, width + 1, size=max(self.depth) + 1)  # width = no true child
        tokens, on_truth = [], []
        for i, p in enumerate(self.parents):
            d, r = self.depth[i], self.rank[i]
            right = (p < 0 or on_truth[p]) and r == good[d] and start + d - 1 < len(self.truth)
            on_truth.append(right)
            true_token = self.truth[min(start + d - 1, len(self.truth) - 1)]
            tokens.append(true_token if right else (true_token + 1 + r) % self.vocab)
        return Draft(mx.array(tokens, dtype=mx.int32), None, list(self.parents))


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_greedy_is_token_identical_to_plain(target, shape):
    V = target.args.vocab_size
    for prompt, max_tokens in itertools.product(PROMPTS, (1, 3, 30)):
        plain = tokens_of(plain_steps(target, prompt, GREEDY, max_tokens))
        for seed, depth in itertools.product(range(3), (None, 2)):
            drafter = ScriptedTree(plain, SHAPES[shape], V, seed)
            events = list(speculative_steps(target, prompt, GREEDY, max_tokens, drafter, num_draft=depth))
            assert tokens_of(events) == plain, (shape, prompt, max_tokens, seed)
            for e in events:
                assert len(e.tokens) == e.accepted + 1 and e.accepted <= e.depth


def noisy_heads(target, heads=4, seed=0, noise=0.05):
    """Medusa heads started from the target's LM head, perturbed."""
    m = MedusaHeads(heads, 1, target.args.hidden_size, target.args.vocab_size)
    m.init_from_target(target)
    rng = np.random.default_rng(seed)
    for head in m.heads:
        head[0].linear.weight = mx.array(noise * rng.standard_normal(head[0].linear.weight.shape).astype(np.float32))
    return m


@pytest.mark.parametrize("tree_args", [{}, {"budget": 8}, {"paths": SHAPES["single-path"]}], ids=["mc_sim", "budget", "chain"])
def test_medusa_greedy_is_token_identical_to_plain(target, tree_args):
    heads = noisy_heads(target)
    for prompt, max_tokens in itertools.product(PROMPTS, (1, 4, 40)):
        plain = tokens_of(plain_steps(target, prompt, GREEDY, max_tokens))
        drafter = Medusa(heads, target, **tree_args)
        events = list(speculative_steps(target, prompt, GREEDY, max_tokens, drafter))
        assert tokens_of(events) == plain, (tree_args, prompt, max_tokens)
    # The heads draft and get accepted (depth fixed: the policy, timing verifications on a loaded machine, may
    # find drafting does not pay and decode plainly)
    events = list(speculative_steps(target, PROMPTS[0], GREEDY, 40, Medusa(heads, target, **tree_args), num_draft=3))
    assert tokens_of(events) == tokens_of(plain_steps(target, PROMPTS[0], GREEDY, 40))
    assert sum(e.accepted for e in events) > 0


# --- exact sampling on trees -----------------------------------------------------


RNG = np.random.default_rng(0)  # the trees' draws, one stream for all the samples


def draw(lp: np.ndarray) -> int:
    p = np.exp(lp)
    return int(RNG.choice(len(p), p=p / p.sum()))


class SampledTree(HostDrafter):
    """Two children per node, two levels, drawn from a draft model.

    `replace=True`: siblings drawn independently from p; `False`: the second
    sibling from p without the first (its log_probs say so); `sample=False`:
    the draft's top-2, deterministic (p one-hot)."""

    def __init__(self, draft, replace=True, sample=True, cache=None):
        super().__init__()
        self.draft, self.replace, self.sample = draft, replace, sample
        self.cache = {} if cache is None else cache  # (context, params) -> the draft's log-probs: it is a function

    def _session(self):
        return SampledTree(self.draft, self.replace, self.sample, self.cache)

    def _p(self, context, params):
        key = (tuple(context), params)
        if key not in self.cache:
            logits, _ = self.draft(mx.array([context]))
            self.cache[key] = np.array(log_probs(logits[0, -1], params), dtype=np.float64)  # [V]
        return self.cache[key]

    def _children(self, context, params):
        lp = self._p(context, params)
        if not self.sample:
            return np.argsort(-lp)[:2].tolist(), None
        first = draw(lp)
        second_lp = lp
        if not self.replace:
            second_lp = np.where(np.arange(len(lp)) == first, -np.inf, lp)
            second_lp = second_lp - np.logaddexp.reduce(second_lp)
        second = draw(second_lp)
        return [first, second], [mx.array(lp, dtype=mx.float32), mx.array(second_lp, dtype=mx.float32)]

    def propose_row(self, b, context, k, params):
        tokens, parents, dists = [], [], []
        level = [(-1, [])]
        for _ in range(min(k, 2)):
            nxt = []
            for node, path in level:
                kids, lps = self._children(context + path, params)
                for j, t in enumerate(kids):
                    tokens.append(t)
                    parents.append(node)
                    if lps is not None:
                        dists.append(lps[j])
                    nxt.append((len(tokens) - 1, path + [t]))
            level = nxt
        lp = mx.stack(dists) if dists else None
        return Draft(mx.array(tokens, dtype=mx.int32), lp, parents)


def no_residual(q, u, tokens, parents, draft_log_probs, rng=np.random.default_rng(0)):
    """A wrong rule: after a rejected sibling, test the next ones and draw the
    token against q itself instead of the residual max(0, q - p) (p one-hot
    for a deterministic tree)."""
    q = q.astype(np.float64)
    p = np.exp(draft_log_probs.astype(np.float64)) if draft_log_probs is not None else np.eye(q.shape[1])[tokens]
    kids = tree.children(parents)
    path, node = [], -1
    while True:
        for c in kids[node]:
            if rng.random() * p[c, tokens[c]] < q[node + 1, tokens[c]]:
                path.append(c)
                node = c
                break
        else:
            return path, int(rng.choice(q.shape[1], p=q[node + 1] / q[node + 1].sum()))


@pytest.fixture(scope="module")
def stat_models():
    return tiny(0, V, logit_scale=0.3), tiny(1, V, logit_scale=0.3, rope_theta=100.0)


@pytest.mark.parametrize(
    "kind,params",
    [
        ("iid", SamplingParams(temp=1.0)),
        ("without-replacement", SamplingParams(temp=1.0)),
        ("top2", SamplingParams(temp=1.0, top_p=0.8)),
    ],
)
def test_tree_sampling_matches_target_distribution(stat_models, kind, params, monkeypatch):
    target, draft = stat_models
    options = {"iid": {}, "without-replacement": {"replace": False}, "top2": {"sample": False}}[kind]
    p = exact_joint(target, STAT_PROMPT, params, 3)
    bound = tv_bound(p, N)
    make = lambda: SampledTree(draft, **options)  # noqa: E731
    assert empirical_tv(target, make, params, p) < bound
    if kind == "iid":
        # The test has teeth: the same check fails for a rule without the residual.
        monkeypatch.setattr(sampling, "accept_tree_sampled", no_residual)
        assert told_apart(target, make, params, p)


def test_typical_acceptance_is_not_exact(stat_models):
    """Medusa's typical acceptance keeps plausible drafts whatever their
    probability under the target: the same check catches it."""
    target, draft = stat_models
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert told_apart(target, lambda: SampledTree(draft, sample=False), params, p, acceptance="typical")


# --- Medusa training -------------------------------------------------------------


def test_trained_medusa_heads_raise_accepted_length(stride_model, tmp_path):
    """`mlx-spec train medusa` on a tiny trained target: on held-out rows, its
    heads (each drafting one candidate: a chain) get accepted."""
    import json

    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data
    from mlx_spec.drafters.medusa import load_medusa

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "medusa"
    proc = cli("train", "medusa", "--target", stride_model, "--data", data, "-o", out, "--heads", "3",
               "--steps", "100", "--batch-size", "16", "--seq-len", "48", "--lr", "3e-3", "--warmup", "10",
               "--save-every", "50", "--quiet", env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["head0_top1"] > 0.5, log[-1]

    target, _ = load_model(str(stride_model))
    trained, _ = load_medusa(str(out))
    untrained = MedusaHeads(3, 1, target.args.hidden_size, target.args.vocab_size)
    untrained.init_from_target(target)
    chain = [[0], [0, 0], [0, 0, 0]]
    taus = [tau_on_held_out_rows(target, stride_model, lambda: Medusa(h, target, paths=chain)) for h in (trained, untrained)]
    assert taus[0] > 1.5 and taus[0] > taus[1] + 0.3, taus
