"""draftsmith.heads.distill: truncated copies, fresh drafts, LoRA merge, the saved directory (round trip,
assisted generation, load_draft) and vocabulary / tokenizer mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from draftsmith.heads.distill import (
    DRAFT_INFO_KEY,
    add_lora,
    check_same_vocab,
    fresh_draft,
    load_draft,
    merge_lora,
    read_draft_info,
    restrict_vocabulary,
    save_draft,
    truncate_model,
)
from draftsmith.heads.distill_loss import forward_kl, jsd
from draftsmith.targets.target import wrap_target

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> {% endif %}"
)


def tiny_tokenizer(words: list[str]):
    """A word-level fast tokenizer: specials then ``words``, with a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(vocab: int = 64, tie: bool = False, seed: int = 0, layers: int = 2):
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


WORDS = [f"w{i}" for i in range(60)]  # 4 specials + 60 words = 64 tokens
# peft 0.21 calls a transformers 5.24 method that warns about its own deprecation
PEFT_WARNING = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"


@pytest.fixture
def tokenizer():
    return tiny_tokenizer(WORDS)


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def target(request, tokenizer):
    return wrap_target(tiny_llama(tie=request.param), tokenizer, name="tiny-target")


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distill_step(draft, target, lr: float = 1e-2) -> None:
    """One optimizer step of forward KL against the target on random tokens."""
    ids = torch.randint(4, target.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target_logits = target.model(input_ids=ids).logits
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=lr)
    loss = forward_kl(draft(input_ids=ids).logits, target_logits, torch.ones(2, 10))
    loss.backward()
    optimizer.step()


def assert_changed_and_untouched(draft_before, draft, target_before, target):
    draft_after = snapshot(draft)
    changed = [k for k in draft_before if not torch.equal(draft_before[k], draft_after[k])]
    assert changed, "the optimizer step changed no draft parameter"
    target_after = snapshot(target.model)
    moved = [k for k in target_before if not torch.equal(target_before[k], target_after[k])]
    assert not moved, f"training the draft changed the target: {moved}"
    return changed


# ---------------------------------------------------------------------------------------------
# (a) truncated copies
# ---------------------------------------------------------------------------------------------


def test_truncated_copy_trains_without_touching_the_target(target):
    draft = load_draft("truncate:1", target, trainable=True)
    assert draft.config.num_hidden_layers == 1 and len(draft.get_decoder().layers) == 1
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in draft.parameters()}
    assert all(p.requires_grad for p in draft.parameters())
    # starts as the target's first layer: same embedding, layer, norm and head values
    torch.testing.assert_close(draft.get_decoder().layers[0].mlp.up_proj.weight,
                               target.layers[0].mlp.up_proj.weight)
    torch.testing.assert_close(draft.get_output_embeddings().weight, target.lm_head.weight)

    draft_before, target_before = snapshot(draft), snapshot(target.model)
    distill_step(draft, target)
    changed = assert_changed_and_untouched(draft_before, draft, target_before, target)
    assert any("embed_tokens" in k for k in changed) and any("layers.0" in k for k in changed)


def test_shared_truncation_is_frozen_and_refuses_lora(target):
    draft = load_draft("truncate:1", target)
    assert draft.get_decoder().layers[0] is target.layers[0]
    assert not any(p.requires_grad for p in draft.parameters())
    with pytest.raises(ValueError, match="shares its layers with the target"):
        add_lora(draft, r=2)
    with pytest.raises(ValueError, match="1 <= N <= 2"):
        truncate_model(target.model, 3)


# ---------------------------------------------------------------------------------------------
# (b) fresh drafts
# ---------------------------------------------------------------------------------------------


def test_fresh_draft_shapes_follow_the_target(target):
    draft = fresh_draft(target, num_layers=1, hidden_size=32)
    config = draft.config
    assert type(draft) is type(target.model)
    # target: hidden 64, 4 heads of 16, 2 kv heads, intermediate 128
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size) == \
        (1, 32, 2, 1, 16, 64)
    assert config.vocab_size == target.vocab_size
    assert draft.get_output_embeddings().weight.shape == (target.vocab_size, 32)
    tied = draft.get_output_embeddings().weight is draft.get_input_embeddings().weight
    assert tied == target.config.tie_word_embeddings
    assert draft.training and all(p.requires_grad for p in draft.parameters())
    assert draft(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, target.vocab_size)

    explicit = fresh_draft(target, num_layers=3, hidden_size=48, intermediate_size=96,
                           num_attention_heads=6, num_key_value_heads=3)
    c = explicit.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size) == (3, 48, 6, 3, 8, 96)
    assert len(explicit.get_decoder().layers) == 3
    # sizes that cannot form attention heads are refused with what to pass
    with pytest.raises(ValueError, match="head_dim"):
        fresh_draft(target, num_layers=1, hidden_size=40)
    with pytest.raises(ValueError, match="must divide"):
        fresh_draft(target, num_layers=1, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_layers"):
        fresh_draft(target, num_layers=0)


def test_fresh_draft_seed_and_target_initialisation(target):
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    a = fresh_draft(target, num_layers=1, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    b = fresh_draft(target, num_layers=1, seed=7)
    c = fresh_draft(target, num_layers=1, seed=8)
    layer = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[layer], b.state_dict()[layer])
    assert not torch.equal(a.state_dict()[layer], c.state_dict()[layer])
    # same width: embedding, final norm and head start as (copies of) the target's
    torch.testing.assert_close(a.get_input_embeddings().weight, target.embed.weight)
    torch.testing.assert_close(a.get_output_embeddings().weight, target.lm_head.weight)
    torch.testing.assert_close(a.get_decoder().norm.weight, target.norm.weight)
    assert a.get_input_embeddings().weight.data_ptr() != target.embed.weight.data_ptr()
    random_init = fresh_draft(target, num_layers=1, init_from_target=False)
    assert not torch.equal(random_init.get_input_embeddings().weight, target.embed.weight)

    draft_before, target_before = snapshot(a), snapshot(target.model)
    distill_step(a, target)
    changed = assert_changed_and_untouched(draft_before, a, target_before, target)
    assert "model.embed_tokens.weight" in changed


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_lora_merge_equals_base_plus_adapter(target):
    draft = load_draft("truncate:2", target, trainable=True)
    base_q = draft.get_decoder().layers[0].self_attn.q_proj.weight.detach().clone()
    r, alpha = 4, 8.0
    peft_model = add_lora(draft, r=r, alpha=alpha, dropout=0.0)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # train the adapters a step (B starts at zero, so an untrained merge would be trivial)
    target_before = snapshot(target.model)
    base_before = {n: p.detach().clone() for n, p in peft_model.named_parameters()
                   if not p.requires_grad}
    distill_step(peft_model, target, lr=5e-2)
    assert all(torch.equal(p, base_before[n]) for n, p in peft_model.named_parameters()
               if not p.requires_grad)
    assert all(torch.equal(v, snapshot(target.model)[k]) for k, v in target_before.items())

    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    lora_a = q_proj.lora_A["default"].weight.detach().clone()  # (r, hidden)
    lora_b = q_proj.lora_B["default"].weight.detach().clone()  # (out, r)
    assert lora_b.abs().sum() > 0
    peft_model.eval()
    ids = torch.tensor([[5, 9, 11, 30, 2, 7]])
    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids).logits
    merged = merge_lora(peft_model)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert type(merged) is type(target.model)
    torch.testing.assert_close(merged.get_decoder().layers[0].self_attn.q_proj.weight,
                               base_q + lora_b @ lora_a * (alpha / r), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted_logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="PeftModel"):
        merge_lora(merged)


# ---------------------------------------------------------------------------------------------
# (c) the saved directory
# ---------------------------------------------------------------------------------------------


def test_save_draft_round_trip_and_assisted_generation(target, tokenizer, tmp_path):
    draft = fresh_draft(target, num_layers=1, seed=3)
    distill_step(draft, target)
    draft.eval()
    out = tmp_path / "artifact"
    built = {"built_from": "fresh", "num_layers": 1, "divergence": "forward_kl", "steps": 1}
    assert save_draft(draft, tokenizer, out, target.identity(), extra=built) == out
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    config = json.loads((out / "config.json").read_text())
    info = config[DRAFT_INFO_KEY]
    assert info["method"] == "draft" and info["target"] == target.identity()
    assert info["built_from"] == "fresh" and info["format_version"] >= 1
    assert read_draft_info(out) == info

    ids = torch.tensor([[1, 5, 9, 11, 30, 7]])
    with torch.no_grad():
        expected = draft(input_ids=ids).logits
    plain = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(plain) is type(target.model)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, expected)
    assert (plain.get_output_embeddings().weight is plain.get_input_embeddings().weight) == \
        target.config.tie_word_embeddings
    reloaded_tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template

    loaded = load_draft(str(out), target)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected)

    # transformers' assisted generation: greedy output identical to plain greedy
    prompt = torch.tensor([target.chat_ids("w1 w2 w3")])
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=3)
    with torch.no_grad():
        reference = target.model.generate(prompt, **kwargs)
        assisted = target.model.generate(prompt, assistant_model=plain, **kwargs)
    assert assisted.tolist() == reference.tolist()

    # saving again replaces the directory in one piece
    save_draft(draft, tokenizer, out, target.identity(), extra={"built_from": "again"})
    assert read_draft_info(out)["built_from"] == "again"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_save_draft_refuses_what_is_not_a_plain_draft(target, tokenizer, tmp_path):
    draft = load_draft("truncate:1", target, trainable=True)
    with pytest.raises(ValueError, match="merge_lora"):
        save_draft(add_lora(draft, r=2), tokenizer, tmp_path / "a", target.identity())
    plain = load_draft("truncate:1", target, trainable=True)
    with pytest.raises(ValueError, match="may not set"):
        save_draft(plain, tokenizer, tmp_path / "b", target.identity(), extra={"method": "x"})
    with pytest.raises(ValueError, match="JSON"):
        save_draft(plain, tokenizer, tmp_path / "c", target.identity(), extra={"t": torch.ones(1)})
    with pytest.raises(ValueError, match="tokenizer"):
        save_draft(plain, None, tmp_path / "d", target.identity())
    wrong = dict(target.identity(), vocab_size=100, name="other")
    with pytest.raises(ValueError, match=r"draft has 64 output tokens, target 'other' has 100"):
        save_draft(plain, tokenizer, tmp_path / "e", wrong)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_vocabulary_and_tokenizer_mismatch_name_both(target, tokenizer, tmp_path):
    # a different vocabulary size
    bigger = tiny_llama(vocab=72, tie=target.config.tie_word_embeddings, layers=1)
    big_dir = tmp_path / "bigger"
    bigger.save_pretrained(str(big_dir))
    tiny_tokenizer(WORDS + [f"x{i}" for i in range(8)]).save_pretrained(str(big_dir))
    with pytest.raises(ValueError, match=r"vocabulary mismatch") as err:
        load_draft(str(big_dir), target)
    assert str(big_dir) in str(err.value) and "'tiny-target'" in str(err.value)
    assert "72" in str(err.value) and "64" in str(err.value)

    # same size, different token -> id mapping
    swapped = tiny_llama(vocab=64, tie=target.config.tie_word_embeddings, layers=1)
    swap_dir = tmp_path / "swapped"
    swapped.save_pretrained(str(swap_dir))
    other_words = list(reversed(WORDS))
    tiny_tokenizer(other_words).save_pretrained(str(swap_dir))
    with pytest.raises(ValueError, match=r"tokenizer mismatch") as err:
        load_draft(str(swap_dir), target)
    assert str(swap_dir) in str(err.value) and "'tiny-target'" in str(err.value)

    # the same checks when called directly
    with pytest.raises(ValueError, match="draft 'mine' has 72 output tokens, target 'tiny-target'"):
        check_same_vocab(target, bigger, draft_name="mine")
    check_same_vocab(target, fresh_draft(target, num_layers=1), tokenizer, draft_name="fresh")
    with pytest.raises(FileNotFoundError, match="neither truncate:N nor a model directory"):
        load_draft(str(tmp_path / "missing"), target)


@pytest.mark.slow
def test_real_smollm2_tokenizer_draft_round_trip(tmp_path):
    """The embedded target's tokenizer with a fresh narrow draft: save, load, assist."""
    from draftsmith.targets.target import load_target

    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    draft = fresh_draft(target, num_layers=2, hidden_size=128, seed=0)
    assert draft.config.vocab_size == 49152 and draft.config.head_dim == 64
    draft.eval()
    out = save_draft(draft, target.tokenizer, tmp_path / "draft", target.identity(),
                     extra={"built_from": "fresh"})
    loaded = load_draft(str(out), target)
    assert read_draft_info(out)["target"]["name"] == "smollm2-135m"
    prompt = torch.tensor([target.chat_ids("What is the capital of France?")])
    kwargs = dict(max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        reference = target.model.generate(prompt, **kwargs)
        assisted = target.model.generate(prompt, assistant_model=loaded, **kwargs)
    assert assisted.tolist() == reference.tolist()


def test_a_draft_over_a_reduced_vocabulary_is_exact_saved_and_refused_elsewhere(
        target, tokenizer, tmp_path):
    """draft_vocab_size: the LM head keeps some rows; the other tokens get probability 0, the
    engine stays exact, the directory round-trips through load_draft and transformers refuses it
    (it would read another model), and so does every export."""
    from draftsmith.eval.engine import SpeculativeEngine
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.layouts.draft import export_layout
    from draftsmith.layouts.files import ExportOptions

    draft = fresh_draft(target, num_layers=1, seed=3)
    full = fresh_draft(target, num_layers=1, seed=3)
    kept = torch.tensor([2] + list(range(4, 40)))  # the end token and 36 words
    restrict_vocabulary(draft, kept)
    ids = torch.tensor([[1, 5, 9, 11, 30, 7]])
    logits = draft(input_ids=ids).logits  # (1, 6, vocab)
    assert logits.shape[-1] == target.vocab_size
    others = torch.ones(target.vocab_size, dtype=torch.bool)
    others[kept] = False
    assert torch.isneginf(logits[..., others]).all()
    torch.testing.assert_close(logits[..., kept], full(input_ids=ids).logits[..., kept])
    assert torch.softmax(logits, -1)[..., others].sum() == 0
    # the divergences the trainer allows stay finite (and train the kept rows)
    loss = jsd(logits, target.model(input_ids=ids).logits.detach(), torch.ones(1, 6))
    loss.backward()
    assert torch.isfinite(loss) and draft.get_output_embeddings().weight.grad.abs().sum() > 0
    draft.zero_grad()
    distill_step_rows = draft.get_output_embeddings().weight.shape
    assert distill_step_rows == (len(kept), target.hidden_size)

    draft.eval()
    out = tmp_path / "artifact"
    save_draft(draft, tokenizer, out, target.identity(), extra={"built_from": "fresh"})
    assert read_draft_info(out)["draft_vocab_size"] == len(kept)
    loaded = load_draft(str(out), target)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, draft(input_ids=ids).logits)
    with pytest.raises((RuntimeError, ValueError), match="size|shape"):
        AutoModelForCausalLM.from_pretrained(str(out))
    with pytest.raises(ValueError, match="reduced vocabulary .* only draftsmith's engine"):
        export_layout(out, "hf", tmp_path / "hf", ExportOptions())

    # exact: greedy decoding with the draft equals plain greedy decoding
    from draftsmith.eval.draft import DraftModelProposer

    engine = SpeculativeEngine(target)
    prompt = target.chat_ids("w1 w2 w3")
    plain = engine.generate(prompt, 24, SamplingParams()).tokens
    drafted = engine.generate(prompt, 24, SamplingParams(),
                              proposer=DraftModelProposer(loaded, max_depth=4)).tokens
    assert drafted == plain
    with pytest.raises(ValueError, match="reduced vocabulary already"):
        restrict_vocabulary(loaded, kept)
