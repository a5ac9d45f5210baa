"""Shared fixtures and helpers: tiny random Llama and Gemma-3 targets and drafts built in memory (no downloads),
the toy trainer, the embedded target's tokenizer, a stop after N steps, small file helpers."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import wrap_target
from draftsmith.train.signals import GracefulStop

TOY = Path(__file__).resolve().parent / "fixtures" / "toy_train.py"

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine extra threads
# oversubscribe the CPU (a 4-row matmul went from 0.5 ms to 24 ms). Slow tests on the real target
# raise this themselves.
torch.set_num_threads(1)


def tiny_llama(vocab: int = 96, hidden: int = 64, layers: int = 2, seed: int = 0,
               dtype: torch.dtype = torch.float64, eos: int | None = None,
               init: float = 0.2) -> LlamaForCausalLM:
    """A random 2-layer Llama; float64 so greedy comparisons have no near-ties from rounding.

    ``init`` is the weight std: larger than the usual 0.02 so outputs are peaked and varied.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=init, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_gemma3(vocab: int = 96, window: int = 8, seed: int = 0, layers: int = 6,
                dtype: torch.dtype = torch.float64, init: float = 0.02) -> Gemma3ForCausalLM:
    """A random Gemma-3: sliding-window layers (``window`` positions) beside global ones (two
    sliding to one global, so 2 global layers of 6), one key/value head, tied and scaled
    embeddings, query/key norms, two rope bases. Weight std 0.02 (Gemma's own): with tied
    embeddings a larger one repeats one token; at 0.02 greedy continuations vary and the window
    changes nearly every token of them."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=window, layer_types=[
            "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=256, initializer_range=init, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Gemma3ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="session")
def tiny_target():
    return wrap_target(tiny_llama(seed=0), name="tiny-target")


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """The model with Gaussian noise on every weight: a draft that agrees often, not always."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise * p.std())
    return draft.requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Same vocabulary, perturbed weights: accepts some tokens and rejects others."""
    return noisy_copy(tiny_target.model, 0.08)


@pytest.fixture
def trainer_env(monkeypatch, tmp_path_factory):
    """Trainer tests: a private target cache, W&B off, one torch thread (restored afterwards)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU is shared
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy():
    spec = importlib.util.spec_from_file_location("toy_train", TOY)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_train"] = module  # dataclass type hints resolve through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("toy_train", None)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class StopAfter(GracefulStop):
    """A stop request after ``STEPS`` optimizer steps, exactly as a SIGTERM would make one."""

    STEPS = 2

    def __enter__(self):
        self.calls = 0
        return super().__enter__()

    def should_stop(self) -> bool:
        self.calls += 1
        if self.calls == self.STEPS:
            self.request(f"a test stop after step {self.STEPS}")
        return super().should_stop()
