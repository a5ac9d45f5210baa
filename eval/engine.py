"""The speculative decoding engine: propose -> verify in one target forward -> accept -> repeat.

Invariant between rounds: the target's KV cache holds every token of the sequence except the
last one (the root of the next tree), and nothing else. A round feeds [root, tree nodes...] with a
4-D tree attention mask and per-node position ids through the target's own transformers modules,
applies the exact acceptance rule, and keeps only the accepted path in the cache. Plain decoding
is the same loop with an empty tree, so every method is measured through identical code.

A round is built to cost what a serving engine's does (docs/evaluator.md, "The engine"):

* the caches are preallocated (:mod:`draftsmith.eval.kv`): the target writes into named slots, the accepted
  path is compacted in place from a device index, and cropping moves a length pointer;
* the tree, its positions and mask, the acceptance (greedy and sampled, chain and tree) and the
  gathers of accepted rows stay on the target's device; the round's one read on the host is the
  accepted path and the next token (:class:`draftsmith.eval.acceptance.TreeOutcome`), through
  :func:`draftsmith.eval.host.to_host`, whose reads the benchmark counts per round;
* the target's attention reads the cache as it is, without copies per layer
  (:mod:`draftsmith.eval.attention`), and with ``compile=True`` the verification forward is compiled
  (:mod:`draftsmith.eval.forward`), two graphs for every tree size and context length.

Every round's tree size, context length and wall time are kept (``Generation.rounds``): the cost
model behind ``--tree auto`` is fitted to rounds like these, and the report compares what it
predicts for the rounds that ran with how long they took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.eval.acceptance import (
    DepthCounts,
    TreeOutcome,
    chain_outcome,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
)
from draftsmith.eval.forward import compiling_seconds, model_forward
from draftsmith.eval.host import host_reads, to_host
from draftsmith.eval.kv import compact
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.sampling import SamplingParams, warp
from draftsmith.eval.tree import DraftTree
from draftsmith.targets.target import Target, attention_bias


@dataclass
class Generation:
    """One generation and its bookkeeping."""

    tokens: list[int]  # new tokens, EOS included when it ended the generation
    prompt_len: int
    target_passes: int = 0  # target forwards while decoding (the prefill is not counted)
    proposed: int = 0  # draft tokens (tree nodes) sent to verification
    acceptance: DepthCounts = field(default_factory=DepthCounts)
    accepted_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per round
    stop_reason: str = "length"
    seconds: float = 0.0
    # every decoding round: (tree nodes, tokens already in the target's cache, seconds)
    rounds: list[tuple[int, int, float]] = field(default_factory=list)
    host_reads: int = 0  # device values read on the host while decoding (draftsmith.eval.host)
    # compiling that happened inside this generation (a graph's first use): left out of
    # ``seconds`` and of every round's seconds
    compile_seconds: float = 0.0
    # with record_logits: the target's logits (vocab,) behind each emitted token, float32 on the
    # CPU (what the greedy-equality report reads at a first differing position)
    logits: list[torch.Tensor] | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decoding rounds (the prefill emits the first one)."""
        return max(0, len(self.tokens) - 1)

    @property
    def tau(self) -> float | None:
        return self.decode_tokens / self.target_passes if self.target_passes else None

    @property
    def alpha(self) -> float | None:
        return self.acceptance.alpha


@dataclass
class DecodeState:
    """Everything a generation carries between rounds (see ``SpeculativeEngine.step``)."""

    seq: list[int]  # prompt + emitted tokens; the target cache holds all but the last
    cache: object
    gen: Generation
    params: SamplingParams
    proposer: Proposer
    generator: torch.Generator | None
    layers: tuple[int, ...]
    max_new_tokens: int
    stop_at_eos: bool
    started: float
    root: torch.Tensor | None = None  # (1,) the last emitted token, on the target's device
    round_started: float = 0.0
    compiled_before: float = 0.0  # draftsmith.eval.forward.compiling_seconds() when the generation began
    round_compiled: float = 0.0  # the same when the round began

    @property
    def done(self) -> bool:
        return self.gen.stop_reason == "eos" or len(self.gen.tokens) >= self.max_new_tokens


def check_prompt(prompt_ids, max_new_tokens: int, vocab_size: int, max_context: int) -> list[int]:
    """Validate a generation request; returns the prompt as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    if len(prompt) >= max_context:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the target's context is {max_context}: "
            "shorten the prompt"
        )
    if len(prompt) + max_new_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
            f"context of {max_context}: use max_new_tokens <= {max_context - len(prompt)}"
        )
    return prompt


def verification_inputs(root: torch.Tensor, dev, past: int, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verification forward's tensors on the device: ids (1, n + 1) = [root, nodes],
    positions (1, n + 1), the additive mask (1, 1, n + 1, past + n + 1) (every node sees the
    cached prefix, itself and its ancestors) and the cache slots (n + 1,)."""
    n = dev.tokens.shape[0]
    device = dev.tokens.device
    ids = torch.cat([root, dev.tokens]).unsqueeze(0)
    slots = torch.arange(past, past + n + 1, device=device)
    positions = (dev.depths + past).unsqueeze(0)
    mask = torch.zeros(1, 1, n + 1, past + n + 1, dtype=dtype, device=device)
    if n:
        mask[0, 0, :, past:] = attention_bias(dev.ancestors, dtype)
    return ids, positions, mask, slots


class SpeculativeEngine:
    """Batch size 1 speculative decoding against a frozen target (see the module docstring).

    ``compile``: compile the target's verification forward (and, where they take it, the
    proposers' drafts: :mod:`draftsmith.eval.forward`); the time compiling takes is :attr:`compile_seconds`,
    never part of a generation's ``seconds`` (a graph compiled mid-generation, at a shape the
    warm-up did not meet, is subtracted and counted in ``Generation.compile_seconds``).
    """

    def __init__(self, target: Target, *, compile: bool | str = False):
        self.target = target
        self.model = target.model
        self.device = target.device
        self.eos = set(target.eos_token_ids)
        self.compile = compile
        self.forward = model_forward(self.model, compile=compile)
        self._empty = DraftTree([], [])  # plain decoding's tree, copied to the device once
        self._empty.device(self.device)

    @property
    def compile_seconds(self) -> float:
        return self.forward.compile_seconds

    @torch.no_grad()
    def generate(self, *args, **kwargs) -> Generation:
        """One whole generation: :meth:`begin` (whose arguments these are), then :meth:`step`
        until it is done; ``seconds`` covers both."""
        state = self.begin(*args, **kwargs)
        while not state.done:
            self.step(state)
        gen = state.gen
        gen.compile_seconds = compiling_seconds() - state.compiled_before
        gen.seconds = time.perf_counter() - state.started - gen.compile_seconds
        return gen

    @torch.no_grad()
    def begin(
        self,
        prompt_ids,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        proposer: Proposer | None = None,
        seed: int | None = 0,
        stop_at_eos: bool = True,
        record_logits: bool = False,
    ) -> DecodeState:
        """Prefill the target on the prompt and emit the first token."""
        params = params or SamplingParams()
        proposer = proposer or Proposer()
        prompt = check_prompt(
            prompt_ids, max_new_tokens, self.target.vocab_size, self.target.max_context
        )
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()
        layers = tuple(proposer.hidden_layers)
        started = time.perf_counter()
        gen = Generation(tokens=[], prompt_len=len(prompt))
        state = DecodeState(
            seq=list(prompt), cache=None, gen=gen, params=params, proposer=proposer,
            generator=generator, layers=layers, max_new_tokens=max_new_tokens,
            stop_at_eos=stop_at_eos, started=started, compiled_before=compiling_seconds())
        state.cache = self.forward.take_cache(state)
        self.forward.cache.reserve(len(prompt) + max_new_tokens + 1)
        n = len(prompt)
        device = self.device
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask = attention_bias(causal, self.target.dtype)[None, None]
        out = self.forward(
            torch.arange(n, device=device), eager=True,
            input_ids=torch.tensor([prompt], device=device), position_ids=torch.arange(
                n, device=device)[None], attention_mask=mask, output_hidden_states=bool(layers),
            logits_to_keep=1)
        state.cache.set_length(n)
        last = out.logits[0, -1]
        first = self._pick(last, params, generator)  # (1,) on the device
        gen.tokens = to_host(first)
        state.seq.append(gen.tokens[0])
        state.root = first
        if record_logits:
            gen.logits = [last.float().cpu()]
        proposer.start(prompt, [out.hidden_states[i] for i in layers] if layers else None,
                       params, generator)
        if stop_at_eos and gen.tokens[0] in self.eos:
            gen.stop_reason = "eos"
        state.round_started = time.perf_counter()
        state.round_compiled = compiling_seconds()
        return state

    @torch.no_grad()
    def step(self, state: DecodeState) -> list[int]:
        """One round: propose, verify in one target forward, accept, compact the caches."""
        self.forward.check_owner(state)
        gen, seq, proposer, params = state.gen, state.seq, state.proposer, state.params
        reads = host_reads()
        remaining = state.max_new_tokens - len(gen.tokens)
        past = len(seq) - 1
        # a round always emits one target token after the accepted ones: depth <= remaining - 1
        tree = proposer.propose(seq, remaining - 1) if remaining > 1 else None
        if tree is None or len(tree) == 0:
            tree = self._empty
        dev = tree.device(self.device)
        ids, positions, mask, slots = verification_inputs(state.root, dev, past,
                                                          self.target.dtype)
        out = self.forward(slots, input_ids=ids, position_ids=positions, attention_mask=mask,
                           output_hidden_states=bool(state.layers))
        logits = out.logits[0]  # (n + 1, V)
        # a proposer may bring its own, explicitly inexact, acceptance rule (Medusa's typical
        # acceptance); such runs are flagged ``exact = False`` and never reported as exact
        lossy = getattr(proposer, "lossy_verify", None)
        if lossy is not None and len(tree):
            outcome = lossy(tree, logits, params, state.generator)
        else:
            outcome = self._accept(tree, logits, params, state.generator)
        if not isinstance(outcome, TreeOutcome):  # (path, next token, tried depths) on the host
            outcome = TreeOutcome(*outcome)
        path, nxt = outcome.path, outcome.next_token  # the round's read on the host
        gen.target_passes += 1
        gen.proposed += len(tree)
        gen.acceptance.add_round(range(1, len(path) + 1), outcome.tried_depths)
        gen.accepted_lengths.append(len(path))
        keep = outcome.keep_index(self.device)
        # a prefix of the verified block (plain decoding, a chain's accepted tokens) needs no copy
        prefix = path == list(range(1, len(path) + 1))
        compact(state.cache, past, None if prefix else keep, len(path) + 1)

        path_tokens = outcome.path_tokens
        if path_tokens is None:
            path_tokens = [tree.tokens[c - 1] for c in path]
        new = list(path_tokens) + [nxt]
        assert len(new) <= remaining, "a proposer exceeded its depth budget"
        if state.stop_at_eos:
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[: i + 1]
                    gen.stop_reason = "eos"
                    break
        if gen.logits is not None:  # the row behind each emitted token: the root's, then the path's
            rows = [0, *path][: len(new)]
            gen.logits.extend(logits[rows].float().cpu().unbind(0))
        gen.tokens.extend(new)
        seq.extend(new)
        state.root = outcome.next_token_tensor(self.device)
        if not state.done:
            tree.verified = (keep, state.root)
            hidden = ([out.hidden_states[i][:, keep] for i in state.layers]
                      if state.layers else None)
            proposer.observe(seq, tree, path, hidden)
        gen.host_reads += host_reads() - reads
        now, compiled = time.perf_counter(), compiling_seconds()
        gen.rounds.append((len(tree), past,
                           now - state.round_started - (compiled - state.round_compiled)))
        state.round_started, state.round_compiled = now, compiled
        return new

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
        """(V,) logits -> (1,) token on the device."""
        if params.greedy:
            return logits.argmax().view(1)
        return torch.multinomial(warp(logits, params), 1, generator=generator)

    def _accept(self, tree: DraftTree, logits: torch.Tensor, params, generator) -> TreeOutcome:
        """The exact rule for this tree, on the device (a host outcome from a rule that
        computes on the host is used as it is)."""
        if len(tree) and tree.is_chain:
            dev = tree.device(logits.device)
            draft = dev.tokens.unsqueeze(0)
            if params.greedy:
                acc, nxt = verify_chain_greedy(draft, logits.unsqueeze(0))
            else:
                draft_probs = tree.chain_draft_probs()
                acc, nxt = verify_chain(
                    draft, warp(logits, params).unsqueeze(0),
                    None if draft_probs is None else draft_probs.unsqueeze(0), generator,
                )
            return chain_outcome(acc[0], nxt[0], dev.tokens)
        return verify_tree(tree, logits, params, generator)


def measure_acceptance(target: Target, proposer: Proposer, prompts: list[list[int]],
                       max_new_tokens: int = 64, params: SamplingParams | None = None,
                       seed: int = 0) -> dict:
    """Acceptance of ``proposer`` over ``prompts`` (training-time evaluation).

    Returns tau, alpha and alpha_per_depth, and the raw counts they come from, so that several
    processes can each measure their share of the prompts and add the counts up:
    ``decode_tokens`` (tokens emitted by decoding rounds), ``target_passes``,
    ``accepted_per_depth`` and ``tried_per_depth`` (lists of ints, index 0 = depth 1). Then
    tau = decode_tokens / target_passes and alpha = sum(accepted) / sum(tried).
    """
    engine = SpeculativeEngine(target)
    counts = DepthCounts()
    decode = passes = 0
    for i, ids in enumerate(prompts):
        budget = min(max_new_tokens, target.max_context - len(ids))
        if budget <= 0:
            continue
        g = engine.generate(ids, budget, params, proposer, seed=seed + i)
        decode += g.decode_tokens
        passes += g.target_passes
        counts.add(g.acceptance)
    return {
        "tau": decode / passes if passes else None,
        "alpha": counts.alpha,
        "alpha_per_depth": counts.alpha_per_depth,
        "decode_tokens": decode,
        "target_passes": passes,
        "accepted_per_depth": list(counts.accepted_per_depth),
        "tried_per_depth": list(counts.tried_per_depth),
    }
