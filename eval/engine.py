"""The speculative decoding engine: propose -> verify in one target forward -> accept -> repeat.

Invariant between rounds: the target's KV cache holds every token of the sequence except the
last one (the root of the next tree), and nothing else. A round feeds [root, tree nodes...] with a
4-D tree attention mask and per-node position ids through the target's own transformers modules,
applies the exact acceptance rule, and keeps only the accepted path in the cache. Plain decoding
is the same loop with an empty tree, so every method is measured through identical code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eval.acceptance import DepthCounts, verify_chain, verify_chain_greedy, verify_tree
from eval.kv import keep_tree_path, new_cache
from eval.proposers import Proposer
from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree
from heads.target import Target, tree_attention_mask


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


class SpeculativeEngine:
    """Batch size 1 speculative decoding against a frozen target."""

    def __init__(self, target: Target):
        self.target = target
        self.model = target.model
        self.device = target.device
        self.eos = set(target.eos_token_ids)

    @torch.no_grad()
    def generate(self, *args, **kwargs) -> Generation:
        """One whole generation: :meth:`begin` (whose arguments these are), then :meth:`step`
        until it is done; ``seconds`` covers both."""
        state = self.begin(*args, **kwargs)
        while not state.done:
            self.step(state)
        state.gen.seconds = time.perf_counter() - state.started
        return state.gen

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
        cache = new_cache(self.model)
        out = self.model(
            input_ids=torch.tensor([prompt], device=self.device), cache=cache, use_cache=True,
            logits_to_keep=1, output_hidden_states=bool(layers),
        )
        first = self._pick(out.logits[0, -1], params, generator)
        gen = Generation(tokens=[first], prompt_len=len(prompt))
        if record_logits:
            gen.logits = [out.logits[0, -1].float().cpu()]
        state = DecodeState(
            seq=prompt + [first], cache=cache, gen=gen,
            params=params, proposer=proposer, generator=generator, layers=layers,
            max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos, started=started,
        )
        proposer.start(prompt, [out.hidden_states[i] for i in layers] if layers else None,
                       params, generator)
        if stop_at_eos and first in self.eos:
            state.gen.stop_reason = "eos"
        return state

    @torch.no_grad()
    def step(self, state: DecodeState) -> list[int]:
        """One round: propose, verify in one target forward, accept, compact caches."""
        gen, seq, proposer, params = state.gen, state.seq, state.proposer, state.params
        remaining = state.max_new_tokens - len(gen.tokens)
        past = len(seq) - 1
        # a round always emits one target token after the accepted ones: depth <= remaining - 1
        tree = proposer.propose(seq, remaining - 1) if remaining > 1 else None
        if tree is None or len(tree) == 0:
            tree = DraftTree([], [])
        logits, hidden = self._verify_forward(seq[-1], tree, past, state.cache, state.layers)
        # a proposer may bring its own, explicitly inexact, acceptance rule (Medusa's typical
        # acceptance); such runs are flagged ``exact = False`` and never reported as exact
        lossy = getattr(proposer, "lossy_verify", None)
        if lossy is not None and len(tree):
            outcome = lossy(tree, logits, params, state.generator)
            path, nxt, tried = outcome.path, outcome.next_token, outcome.tried_depths
        else:
            path, nxt, tried = self._accept(tree, logits, params, state.generator)
        gen.target_passes += 1
        gen.proposed += len(tree)
        gen.acceptance.add_round([tree.depths[c] for c in path], tried)
        gen.accepted_lengths.append(len(path))
        keep_tree_path(state.cache, past, [0] + path)

        new = [tree.tokens[c - 1] for c in path] + [nxt]
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
        if not state.done:
            rows = [0] + path
            proposer.observe(seq, tree, path, [h[:, rows] for h in hidden] if hidden else None)
        return new

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator) -> int:
        if params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(warp(logits, params), 1, generator=generator))

    def _verify_forward(self, root: int, tree: DraftTree, past: int, cache, layers):
        """One target forward over [root] + tree nodes -> logits (n+1, V), hidden states."""
        ids = torch.tensor([[root, *tree.tokens]], device=self.device)
        kwargs = {}
        if not tree.is_chain:
            kwargs["attention_mask"] = tree_attention_mask(
                tree.ancestor_mask(), past, self.target.dtype, self.device)
            kwargs["position_ids"] = torch.tensor([[past + d for d in tree.depths]], device=self.device)
        out = self.model(
            input_ids=ids, cache=cache, use_cache=True, output_hidden_states=bool(layers), **kwargs
        )
        hidden = [out.hidden_states[i] for i in layers] if layers else None
        return out.logits[0], hidden

    def _accept(self, tree: DraftTree, logits: torch.Tensor, params, generator):
        """-> accepted path (node indices), next token, depths at which a child was tested."""
        k = len(tree)
        if k == 0:
            return [], self._pick(logits[0], params, generator), []
        if not tree.is_chain:
            outcome = verify_tree(tree, logits, params, generator)
            return outcome.path, outcome.next_token, outcome.tried_depths
        draft = torch.tensor([tree.tokens], device=logits.device)
        if params.greedy:
            acc, nxt = verify_chain_greedy(draft, logits.unsqueeze(0))
        else:
            draft_probs = tree.chain_draft_probs()
            acc, nxt = verify_chain(
                draft, warp(logits, params).unsqueeze(0),
                None if draft_probs is None else draft_probs.unsqueeze(0), generator,
            )
        accepted = int(acc)
        return list(range(1, accepted + 1)), int(nxt), list(range(1, min(accepted + 1, k) + 1))


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
