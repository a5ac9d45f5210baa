"""What a round costs on this machine, timed as the engine runs it: the cost model.

A speculative round is propose -> verify -> accept -> compact -> observe. Its cost is split in two
parts, each timed on whole rounds of :class:`draftsmith.eval.engine.SpeculativeEngine` (so whatever a round
does, masks, gathers, the acceptance and the host read included, is in the figure):

* **the engine's side**, ``E(n, c)``: a round verifying a tree of ``n`` draft tokens (0 is plain
  decoding) with ``c`` tokens already cached, everything but the proposer's own work. Timed with
  :class:`ReplayTree`, a proposer whose trees are made once on the device and cost nothing to
  propose, cycling through the sizes at several context lengths; each size's seconds are fitted
  by a line in ``c`` (:func:`engine_costs`).
* **the draft's side**, ``D(c)``: what one method's proposer adds to a round. Timed on the
  method's own rounds at several context lengths: each round's seconds minus ``E`` at its size
  and context, fitted by a line in ``c`` (:func:`draft_costs`).

A round of a method is predicted to cost ``E(n, c) + D(c)``; ``--tree auto`` compares trees with
it, and the benchmark predicts every method's decoding time from the rounds that actually ran
(their sizes and contexts) and reports it beside the measured time (:func:`predict_seconds`).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from draftsmith.eval.proposers import Proposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.tree import DraftTree

ROUND_SIZES = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 23, 31, 47, 63)  # draft tokens per round timed
COST_CONTEXTS = (128, 512)  # tokens cached when rounds are timed (a line through them)
COST_REPEATS = 5  # rounds of each size at each context (the first pass is a warm-up)
KINDS = ("tree", "chain")


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line (a, b) of y = a + b x; a flat line through the median with one x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return statistics.median(y for _, y in points), 0.0
    mx = statistics.fmean(xs)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _robust(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points within 3 median absolute deviations of their context's median (a round the
    machine interrupted says nothing about what a round costs)."""
    kept = []
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(x, []).append(y)
    for x, ys in by_x.items():
        med = statistics.median(ys)
        # a draft's side (its rounds minus the engine's) can be at or below 0 on a tiny model
        mad = statistics.median(abs(y - med) for y in ys) or abs(med) * 0.02
        kept += [(x, y) for y in ys if abs(y - med) <= 3 * mad]
    return kept


@dataclass
class RoundCosts:
    """``engine[kind][n] = (a, b)``: the engine's side of a round of n draft tokens costs
    a + b * context seconds; ``draft`` the same line for one method's proposer (None: not
    measured, counted as 0)."""

    engine: dict[str, dict[int, tuple[float, float]]]
    draft: tuple[float, float] | None = None
    contexts: tuple[int, ...] = COST_CONTEXTS
    extra: dict = field(default_factory=dict)

    def engine_seconds(self, n: int, context: float, kind: str = "tree") -> float:
        table = self.engine[kind if kind in self.engine else "tree"]
        sizes = sorted(table)
        if n in table:
            a, b = table[n]
            return a + b * context
        if n > sizes[-1]:  # beyond the largest size timed: the last step's slope
            lo, hi = sizes[-2], sizes[-1]
        else:
            hi = next(s for s in sizes if s > n)
            lo = max(s for s in sizes if s < n)
        w = (n - lo) / (hi - lo)
        a = table[lo][0] * (1 - w) + table[hi][0] * w
        b = table[lo][1] * (1 - w) + table[hi][1] * w
        return a + b * context

    def draft_seconds(self, context: float) -> float:
        if self.draft is None:
            return 0.0
        a, b = self.draft
        return max(0.0, a + b * context)

    def round_seconds(self, n: int, context: float, kind: str = "tree") -> float:
        return self.engine_seconds(n, context, kind) + self.draft_seconds(context)

    def with_draft(self, draft: tuple[float, float] | None) -> RoundCosts:
        return RoundCosts(self.engine, draft, self.contexts)

    def to_dict(self) -> dict:
        return {"engine": {kind: {str(n): list(line) for n, line in table.items()}
                           for kind, table in self.engine.items()},
                "draft": None if self.draft is None else list(self.draft),
                "contexts": list(self.contexts)}

    @classmethod
    def from_dict(cls, data: dict) -> RoundCosts:
        engine = {kind: {int(n): (float(a), float(b)) for n, (a, b) in table.items()}
                  for kind, table in data["engine"].items()}
        draft = data.get("draft")
        return cls(engine, None if draft is None else (float(draft[0]), float(draft[1])),
                   tuple(data.get("contexts") or COST_CONTEXTS))


def costs_problem(data) -> str | None:
    """What is wrong with a stored cost record (None: usable)."""
    try:
        costs = RoundCosts.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError):
        return "not a table of engine costs per round size"
    if not costs.engine or any(0 not in table or len(table) < 2 for table in costs.engine.values()):
        return "the engine's costs need plain decoding (0) and at least one tree size"
    return None


class ReplayTree(Proposer):
    """Every round the next size of ``sizes`` (cycled), as a tree made once on the device, so
    that proposing costs nothing: what is timed is the engine's side of the round. ``kind``
    "tree" draws random parents (seeded), "chain" a chain; the tokens are random."""

    name = "replay"

    def __init__(self, sizes, device, vocab: int, kind: str = "tree", seed: int = 0):
        rng = random.Random(seed)
        self.sizes = list(sizes)
        self._trees: dict[int, tuple] = {}
        gen = torch.Generator().manual_seed(seed)
        for n in set(self.sizes):
            if n == 0:
                continue
            parents = (list(range(n)) if kind == "chain" else
                       [rng.randrange(0, i) if i > 1 else 0 for i in range(1, n + 1)])
            host = DraftTree([0] * n, parents)
            tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
            self._trees[n] = (tokens, torch.tensor(parents, device=device),
                              host.ancestor_mask().to(device),
                              torch.tensor(host.depths, device=device), parents,
                              host.max_depth, kind == "chain")
        self.turn = 0

    def propose(self, seq, max_depth):
        n = self.sizes[self.turn % len(self.sizes)]
        self.turn += 1
        if n == 0:
            return None
        tokens, parents, ancestors, depths, host, bound, chain = self._trees[n]
        if bound > max_depth:
            return None
        return DraftTree.from_tensors(tokens, parents, depth_bound=bound, chain=chain,
                                      ancestors=ancestors, depths=depths, host_parents=host)


class timed_proposer:
    """Within the block, ``proposer``'s ``propose`` and ``observe`` are timed (the device
    synchronised around each): ``.propose`` and ``.observe`` collect their seconds."""

    def __init__(self, proposer, device: torch.device):
        self.proposer, self.device = proposer, device
        self.propose: list[float] = []
        self.observe: list[float] = []

    def _wrap(self, name: str, into: list[float]):
        original = getattr(self.proposer, name)

        def timed(*args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            out = original(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            into.append(time.perf_counter() - started)
            return out
        return timed

    def __enter__(self) -> timed_proposer:
        self.proposer.propose = self._wrap("propose", self.propose)
        self.proposer.observe = self._wrap("observe", self.observe)
        return self

    def __exit__(self, *exc) -> None:
        del self.proposer.propose, self.proposer.observe

    def seconds(self) -> float:
        """A round's drafting: the median propose and the median observe."""
        return (statistics.median(self.propose) if self.propose else 0.0) + (
            statistics.median(self.observe) if self.observe else 0.0)


def _context_prompt(vocab: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _rounds(engine, proposer, prompt: list[int], rounds: int,
            params: SamplingParams | None = None, room: int = 64) -> list[tuple[int, int, float]]:
    """(draft tokens, cached tokens, seconds) of ``rounds`` rounds after ``prompt``, each with
    room for ``room`` draft tokens (fewer where the target's context ends)."""
    budget = min(rounds * (room + 1) + 1, engine.target.max_context - len(prompt))
    state = engine.begin(prompt, budget, params or SamplingParams(), proposer, seed=0,
                         stop_at_eos=False)
    for _ in range(rounds):
        if state.done:
            break
        engine.step(state)
    return state.gen.rounds


def fitting(max_context: int, sizes, contexts) -> tuple[list[int], tuple[int, ...]]:
    """The sizes and contexts that fit a target's context (a small test model's, say): sizes up
    to a quarter of it, contexts that leave room for a pass over every size."""
    sizes = sorted({n for n in sizes if n <= max_context // 4} | {0, 1})
    room = len(sizes) + sizes[-1] + 2
    kept = tuple(c for c in contexts if c + room <= max_context)
    return sizes, kept or (max(4, (max_context - room) // 2),)


def replay_rounds(engine, sizes, context: int, passes: int, *, kind: str = "tree",
                  seed: int = 0) -> list[tuple[int, int, float]]:
    """``passes`` passes over ``sizes``, each a generation after the same ``context`` random
    tokens (so the context stays put), rounds of :class:`ReplayTree`."""
    target = engine.target
    prompt = _context_prompt(target.vocab_size, context, seed)
    rounds = []
    for _ in range(passes):
        proposer = ReplayTree(sizes, engine.device, target.vocab_size, kind, seed=seed)
        rounds += _rounds(engine, proposer, prompt, len(sizes), room=max(sizes))
    return rounds


def engine_costs(engine, sizes=ROUND_SIZES, contexts=COST_CONTEXTS, repeats: int = COST_REPEATS,
                 kinds=KINDS) -> RoundCosts:
    """The engine's side of a round, ``E(n, c)`` (see the module docstring)."""
    sizes, contexts = fitting(engine.target.max_context, sizes, contexts)
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for kind in kinds:
        points: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
        for i, context in enumerate(contexts):
            rounds = replay_rounds(engine, sizes, context, repeats + 1, kind=kind, seed=i)
            for n, past, seconds in rounds[len(sizes):]:  # the first pass warms up
                points[n].append((past, seconds))
        table[kind] = {n: _fit(_robust(p)) for n, p in points.items() if p}
    return RoundCosts(table, None, tuple(contexts))


def draft_costs(engine, proposer, costs: RoundCosts, prompts: list[list[int]], *,
                contexts=COST_CONTEXTS, rounds: int = 8, kind: str = "tree",
                params: SamplingParams | None = None) -> tuple[float, float]:
    """A proposer's side of a round, ``D(c)`` (see the module docstring): its own rounds after
    each prompt cut or repeated to each context length, minus the engine's side."""
    points = []
    _, contexts = fitting(engine.target.max_context - rounds - 4, ROUND_SIZES, contexts)
    for i, context in enumerate(contexts):
        prompt = list(prompts[i % len(prompts)])
        prompt = (prompt * (context // max(1, len(prompt)) + 1))[:context]
        timed = _rounds(engine, proposer, prompt, rounds + 2, params)[2:]  # two to warm up
        points += [(past, seconds - costs.engine_seconds(n, past, kind))
                   for n, past, seconds in timed]
    return _fit(_robust(points))


def predict_seconds(costs: RoundCosts, rounds: list[tuple[int, int, float]],
                    kind: str = "tree") -> float:
    """The seconds the cost model gives the rounds that ran (their sizes and contexts)."""
    return sum(costs.round_seconds(n, past, kind) for n, past, _ in rounds)


PREDICTION_FLAG = 0.15  # a prediction further than this from the measured figure is flagged


def cost_model_records(methods, records: list[dict], runs, prompts: list[list[int]],
                       params: SamplingParams | None = None) -> dict | None:
    """The cost model of every engine method of a benchmark, measured after its runs, and what
    it predicts for the rounds that ran beside what they took (in place: each record's
    ``cost_model``); -> the engine's costs (None: no engine method)."""
    from draftsmith.eval.runners import EngineMethod

    engine_methods = [m for m in methods if isinstance(m, EngineMethod)]
    if not engine_methods:
        return None
    engine = engine_methods[0].engine
    kinds = sorted({"chain" if getattr(m.proposer, "chains", False) else "tree"
                    for m in engine_methods})
    started = time.perf_counter()
    costs = engine_costs(engine, kinds=kinds)
    for method, record, run in zip(methods, records, runs, strict=True):
        if not isinstance(method, EngineMethod):
            continue
        kind = "chain" if getattr(method.proposer, "chains", False) else "tree"
        draft = None
        if method.proposer is not None:
            draft = draft_costs(engine, method.proposer, costs, prompts[:2], kind=kind,
                                params=params)
        model = costs.with_draft(draft)
        rounds = [r for repeat in run.runs for prompt in repeat for r in (prompt.rounds or [])]
        if not rounds:
            continue
        measured = sum(seconds for *_, seconds in rounds)
        predicted = predict_seconds(model, rounds, kind)
        tokens = sum(prompt.decode_tokens for repeat in run.runs for prompt in repeat)
        error = measured / predicted - 1 if predicted else None  # predicted tok/s vs measured
        record["cost_model"] = {
            "kind": kind, "draft_seconds_line": None if draft is None else list(draft),
            "predicted_decode_seconds": round(predicted, 3),
            "measured_decode_seconds": round(measured, 3),
            "predicted_decode_tokens_per_s": round(tokens / predicted, 3) if predicted else None,
            "measured_decode_tokens_per_s": round(tokens / measured, 3) if measured else None,
            "prediction_error": None if error is None else round(error, 4),
            "flagged": error is not None and abs(error) > PREDICTION_FLAG,
        }
    return {**costs.to_dict(), "seconds": round(time.perf_counter() - started, 1),
            "flag_beyond": PREDICTION_FLAG}
