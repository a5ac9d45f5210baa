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
from itertools import zip_longest

import torch

from eval.acceptance import verify_chain, verify_chain_greedy, verify_tree
from eval.kv import keep_tree_path, new_cache
from eval.proposers import Proposer
from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree
from heads.target import Target


@dataclass
class Generation:
    """One generation and its bookkeeping."""

    tokens: list[int]  # new tokens, EOS included when it ended the generation
    prompt_len: int
    target_passes: int = 0  # target forwards while decoding (the prefill is not counted)
    proposed: int = 0  # draft tokens (tree nodes) sent to verification
    accepted_at: list[int] = field(default_factory=list)  # accepted draft tokens per depth (1-based)
    tried_at: list[int] = field(default_factory=list)  # rounds whose walk tested a child per depth
    stop_reason: str = "length"
    seconds: float = 0.0

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decoding rounds (the prefill emits the first one)."""
        return max(0, len(self.tokens) - 1)

    @property
    def tau(self) -> float | None:
        return self.decode_tokens / self.target_passes if self.target_passes else None

    @property
    def alpha(self) -> float | None:
        tried = sum(self.tried_at)
        return sum(self.accepted_at) / tried if tried else None

    def count(self, path_depths: list[int], tried_depths: list[int]) -> None:
        for bucket, depths in ((self.accepted_at, path_depths), (self.tried_at, tried_depths)):
            for d in depths:
                while len(bucket) < d:
                    bucket.append(0)
                bucket[d - 1] += 1


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
    def generate(
        self,
        prompt_ids,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        proposer: Proposer | None = None,
        seed: int | None = 0,
        stop_at_eos: bool = True,
    ) -> Generation:
        state = self.begin(prompt_ids, max_new_tokens, params, proposer, seed, stop_at_eos)
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
        state = DecodeState(
            seq=prompt + [first], cache=cache, gen=Generation(tokens=[first], prompt_len=len(prompt)),
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
        gen.count([tree.depths[c] for c in path], tried)
        keep_tree_path(state.cache, past, [0] + path)

        new = [tree.tokens[c - 1] for c in path] + [nxt]
        assert len(new) <= remaining, "a proposer exceeded its depth budget"
        if state.stop_at_eos:
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[: i + 1]
                    gen.stop_reason = "eos"
                    break
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
            n = len(tree) + 1
            dtype = self.target.dtype
            mask = torch.full((1, 1, n, past + n), torch.finfo(dtype).min, dtype=dtype)
            mask[..., :past] = 0
            mask[0, 0, :, past:].masked_fill_(tree.ancestor_mask(), 0)
            kwargs["attention_mask"] = mask.to(self.device)
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
    """tau, alpha and alpha per depth of ``proposer`` over ``prompts`` (training-time evaluation)."""
    engine = SpeculativeEngine(target)
    total = Generation(tokens=[], prompt_len=0)
    decode = 0
    for i, ids in enumerate(prompts):
        budget = min(max_new_tokens, target.max_context - len(ids))
        if budget <= 0:
            continue
        g = engine.generate(ids, budget, params, proposer, seed=seed + i)
        decode += g.decode_tokens
        total.target_passes += g.target_passes
        for depth, (a, t) in enumerate(zip_longest(g.accepted_at, g.tried_at, fillvalue=0), start=1):
            total.count([depth] * a, [depth] * t)
    tried = total.tried_at
    accepted = [a for a, _ in zip_longest(total.accepted_at, tried, fillvalue=0)]
    return {
        "tau": decode / total.target_passes if total.target_passes else None,
        "alpha": total.alpha,
        "alpha_per_depth": [a / t if t else None for a, t in zip(accepted, tried)],
        # the raw counts, so that measurements on several processes can be summed
        "decode_tokens": decode,
        "target_passes": total.target_passes,
        "accepted_per_depth": accepted,
        "tried_per_depth": list(tried),
    }
