"""The baselines every benchmark measures the drafts against: our engine without a draft, with
n-gram prompt lookup, and transformers' own ``generate``, its prompt lookup and its assisted
generation.

    plain         our engine, one target forward per token
    hf            transformers generate (the greedy reference, a peer with its own ratio)
    hf-static     generate with transformers' static cache, its decoding step compiled
    pld           our engine with n-gram prompt lookup (the --pld-* flags)
    hf-pld        generate(prompt_lookup_num_tokens=--pld-depth)
    hf-assisted:<dir|truncate:N>   generate(assistant_model=...)
    ngram:<type>  llama.cpp's own n-gram lookup (--engine llama.cpp only)

``plain`` is the baseline of ``speedup`` in both engines (with ``--engine llama.cpp``, llama.cpp's
own plain decoding: ``serve_plain``); transformers' methods are peers with their own ratio.
"""

from __future__ import annotations

from draftsmith.eval.proposers import NgramProposer
from draftsmith.eval.runners import (
    BuildContext,
    EngineMethod,
    HFMethod,
    OptionFlag,
    int_at_least,
    signature_default,
)

PLD_FLAGS = (
    OptionFlag("pld", NgramProposer, "max_ngram", "--pld-max-ngram", int_at_least(1),
               "pld: longest n-gram matched"),
    OptionFlag("pld", NgramProposer, "min_ngram", "--pld-min-ngram", int_at_least(1),
               "pld: shortest n-gram matched"),
    OptionFlag("pld", NgramProposer, "max_depth", "--pld-depth", int_at_least(1),
               "pld: tokens continued after a match; also hf-pld's prompt_lookup_num_tokens"),
    OptionFlag("pld", NgramProposer, "max_branches", "--pld-branches", int_at_least(1),
               "pld: continuations of distinct earlier matches merged into a tree"),
    OptionFlag("pld", NgramProposer, "tree_nodes", "--pld-tree-nodes", int_at_least(1),
               "pld: nodes of the n-gram tree"),
)


def build_plain(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    return EngineMethod(name, ctx.engine, None)


def build_hf(arg: str, name: str, ctx: BuildContext) -> HFMethod:
    return HFMethod(name, ctx.target)


def build_hf_static(arg: str, name: str, ctx: BuildContext) -> HFMethod:
    """transformers' compiled static-cache ``generate``: its StaticCache sized for the longest
    prompt of the run plus the new tokens (one compiled graph), compiled with transformers' own
    settings (``reduce-overhead`` on a GPU; inductor's default on a CPU, where transformers
    compiles only when asked)."""
    from transformers import CompileConfig

    config = CompileConfig() if ctx.target.device.type == "cuda" else CompileConfig(mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling on a CPU
    return HFMethod(name, ctx.target, cache_implementation="static", compile_config=config,
                    max_cache_len=ctx.max_cache_len or ctx.target.max_context)


def build_pld(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    return EngineMethod(name, ctx.engine, NgramProposer(**ctx.kind_options("pld")))


def build_hf_pld(arg: str, name: str, ctx: BuildContext) -> HFMethod:
    depth = ctx.kind_options("pld").get("max_depth",
                                        signature_default(NgramProposer, "max_depth"))
    return HFMethod(name, ctx.target, prompt_lookup_num_tokens=depth)


def build_hf_assisted(arg: str, name: str, ctx: BuildContext) -> HFMethod:
    from draftsmith.heads.distill import DraftVocabHead

    draft = ctx.draft(arg)
    if isinstance(draft.get_output_embeddings(), DraftVocabHead):
        raise ValueError(f"{name}: {arg} has a reduced vocabulary, which transformers' assisted "
                         f"generation does not know; measure it with --method draft:{arg}")
    return HFMethod(name, ctx.target, assistant_model=draft)


# llama.cpp's own n-gram lookups (its --spec-type values)
LLAMA_NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def serve_plain(arg: str, name: str, ctx) -> list[str]:
    return []


def serve_ngram(arg: str, name: str, ctx) -> list[str]:
    if arg not in LLAMA_NGRAM_TYPES:
        raise ValueError(f"{name!r}: llama.cpp's n-gram types are {', '.join(LLAMA_NGRAM_TYPES)}")
    return ["--spec-type", arg] + (["--spec-draft-n-max", str(ctx.draft_max)]
                                   if ctx.draft_max else [])
