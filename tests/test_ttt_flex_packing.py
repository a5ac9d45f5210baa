"""EAGLE's training-time-test attention through flex attention, its block mask, the fused SDPA
path without masks it does not need, and packed rows (several documents in one row).

Flex attention has no backward on a CPU in torch (``NotImplementedError``), so its gradients are
checked here as the derivatives of the function it computes: central differences of the flex
kernel's output in float64 against the SDPA kernel's autograd gradient, along random directions.
``scripts/gpu_check.sh`` compares the two kernels' autograd gradients on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_eagle_training import make_batch, make_head, make_target, with_features
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from draftsmith.heads.eagle_loss import eagle_loss
from draftsmith.heads.ttt_attention import (
    BLOCK,
    documents_of,
    flex_ttt_attention,
    sdpa_ttt_attention,
    ttt_block_mask,
)
from draftsmith.train.rows import pack_rows


def random_inputs(n, *, steps=3, batch=2, heads=4, kv_heads=2, dim=16, dtype=torch.float64,
                  seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=dtype)
    keys = [torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=dtype) for _ in range(steps)]
    values = [torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=dtype)
              for _ in range(steps)]
    return q, keys, values


def layouts(n, batch=2):
    """(name, key_valid, documents): right-padded (no mask), holes, packed documents, both."""
    holes = torch.ones(batch, n, dtype=torch.bool)
    holes[-1, :5] = False
    holes[-1, n - 9:] = False
    lengths = (n // 3, n - n // 3 - 11, 11)
    documents = documents_of(torch.cat([torch.arange(k) for k in lengths])[None].expand(batch, -1))
    return [("plain", None, None), ("holes", holes, None), ("documents", None, documents),
            ("documents+holes", holes, documents)]


def flex_along(inputs, direction, eps, steps, valid, documents, probe) -> torch.Tensor:
    """sum(flex output x probe) at inputs + eps x direction (q, then keys, then values)."""
    moved = [x.detach() + eps * u for x, u in zip(inputs, direction)]
    out = flex_ttt_attention(moved[0], moved[1:1 + steps], moved[1 + steps:], scaling=0.3,
                             key_valid=valid, documents=documents)
    return (out * probe).sum()


def largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation while ``fn`` runs (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


# ------------------------------------------------------------------------------------------------
# flex attention = the SDPA kernel


@pytest.mark.parametrize("n", [23, 200])
def test_flex_attention_matches_the_sdpa_kernel_in_outputs_and_derivatives(n):
    """Every layout and step: outputs to 1e-12 (float64); the derivative of flex's output along
    random directions of q, every step's keys and values (central differences) equals the SDPA
    kernel's autograd gradient along them."""
    for name, valid, documents in layouts(n):
        rows = 1 if valid is None else valid[:, None, :, None]  # padded queries' outputs unused
        for steps in (1, 2, 4):
            q, keys, values = random_inputs(n, steps=steps, seed=steps)
            flex = flex_ttt_attention(q, keys, values, scaling=0.3, key_valid=valid,
                                      documents=documents)
            inputs = [x.clone().requires_grad_() for x in (q, *keys, *values)]
            sdpa = sdpa_ttt_attention(inputs[0], inputs[1:1 + steps], inputs[1 + steps:],
                                      scaling=0.3, key_valid=valid, documents=documents)
            torch.testing.assert_close(flex * rows, sdpa * rows, rtol=1e-12, atol=1e-12,
                                       msg=f"{name}, {steps} steps")
            probe = torch.randn(sdpa.shape, generator=torch.Generator().manual_seed(9),
                                dtype=sdpa.dtype) * rows
            (sdpa * probe).sum().backward()
            gen = torch.Generator().manual_seed(steps)
            for _ in range(2):
                direction = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in inputs]
                at = [flex_along(inputs, direction, sign * 1e-6, steps, valid, documents, probe)
                      for sign in (1, -1)]
                numeric = (at[0] - at[1]) / 2e-6
                analytic = sum((x.grad * u).sum() for x, u in zip(inputs, direction))
                assert numeric == pytest.approx(float(analytic), rel=1e-7, abs=1e-8), \
                    f"{name}, {steps} steps"


def test_flex_block_mask_tables_hold_every_allowed_entry_and_full_tiles_are_full():
    """Tiles left out hold no allowed (query, key); tiles marked full are allowed everywhere.
    The tables decide what the compiled kernel computes; the uncompiled one reads the mask
    function alone, so they are checked here tile by tile against it."""
    n, steps = 3 * BLOCK + 41, 3
    kinds = set()
    for name, valid, documents in layouts(n):
        mask = ttt_block_mask(n, steps, key_valid=valid, documents=documents, batch=2,
                              device="cpu")
        dense = mask.to_dense()  # (B, 1, q tiles, kv tiles): tiles computed at all
        full = torch.zeros_like(dense)
        counts, index = mask.full_kv_num_blocks, mask.full_kv_indices
        for b in range(2):
            for qt in range(dense.shape[2]):
                full[b, 0, qt, index[b, 0, qt, :counts[b, 0, qt]]] = 1
        b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(n),
                                  torch.arange(steps * dense.shape[2] * BLOCK), indexing="ij")
        allowed = mask.mask_mod(b, 0, q, kv)  # (B, n, kv)
        tile = allowed.reshape(2, n, -1, BLOCK).any(-1)  # (B, n, kv tiles)
        per_tile = torch.stack([tile[:, t * BLOCK:(t + 1) * BLOCK].any(1)
                                for t in range(dense.shape[2])], dim=1)  # (B, q tiles, kv tiles)
        assert not (per_tile & ~dense[:, 0].bool()).any(), name
        assert not (full[:, 0].bool() & ~dense[:, 0].bool()).any(), name
        everywhere = allowed.reshape(2, n, -1, BLOCK).all(-1)
        for t in range(dense.shape[2]):
            rows = everywhere[:, t * BLOCK:(t + 1) * BLOCK].all(1)  # (B, kv tiles)
            assert not (full[:, 0, t].bool() & ~rows).any(), (name, t)
        kinds |= {"full"} if full.sum() else set()
        kinds |= {"partial"} if dense.sum() > full.sum() else set()
    assert kinds == {"full", "partial"}


def test_flex_attention_compiled_allocates_no_n_by_n_tensor():
    """Measured with torch's profiler on this CPU: the compiled flex kernel (the GPU path's
    kernel, forward) and the block mask it reads allocate nothing near one (n, n) fp32 tensor;
    uncompiled flex, which evaluates the mask densely, does (the measurement can see one)."""
    n, steps = 8 * BLOCK, 3
    q, keys, values = random_inputs(n, steps=steps, batch=1, heads=2, kv_heads=1, dim=16,
                                    dtype=torch.float32)
    _, _, documents = layouts(n, batch=1)[2]
    square = n * n * 4
    compiled = flex_ttt_attention(q, keys, values, scaling=0.25, documents=documents,
                                  compiled=True)  # compiles once
    eager = flex_ttt_attention(q, keys, values, scaling=0.25, documents=documents)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    mask_bytes = largest_allocation(lambda: ttt_block_mask(
        n, steps, key_valid=None, documents=documents, batch=1, device="cpu"))
    kernel_bytes = largest_allocation(lambda: flex_ttt_attention(
        q, keys, values, scaling=0.25, documents=documents, compiled=True))
    eager_bytes = largest_allocation(lambda: flex_ttt_attention(
        q, keys, values, scaling=0.25, documents=documents))
    assert eager_bytes >= square  # the dense evaluation: (B, H, n, steps x n) scores
    assert mask_bytes < square / 64, mask_bytes
    assert kernel_bytes < square / 16, kernel_bytes  # outputs and laid-out keys: O(n x d)


def test_the_sdpa_kernel_builds_no_mask_for_right_padded_rows_and_one_for_packing():
    """Right-padded rows: step 0 is plain causal SDPA and later steps a lower-right causal bias,
    no tensor mask; rows with holes and packed rows get one per step (the controls). Recorded as
    torch dispatches them."""

    class Recording(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                self.calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask")))
            return func(*args, **kwargs)

    target = make_target()
    head = make_head(target, 3)
    batch = with_features(target, head, make_batch(target))  # right-padded rows of 23, 17, 9
    with Recording() as plain:
        eagle_loss(head, batch, steps=3, chunk_size=5, attention="sdpa")
    assert [is_causal for is_causal, _ in plain.calls] == [True, False, False]
    assert plain.calls[0][1] is None
    assert all(isinstance(mask, CausalBias) for _, mask in plain.calls[1:])
    with Recording() as holes:
        eagle_loss(head, batch, steps=3, chunk_size=5, attention="sdpa", padding="any")
    assert len(holes.calls) == 3
    assert all(type(mask) is torch.Tensor and mask.dtype == torch.bool for _, mask in holes.calls)
    packed = pack_rows(unpadded_rows(batch))
    packed.update(ttt_features(target, head, packed))
    with Recording() as documents:
        eagle_loss(head, packed, steps=3, chunk_size=5, attention="sdpa")
    assert len(documents.calls) == 3
    assert all(type(mask) is torch.Tensor and mask.dtype == torch.bool
               for _, mask in documents.calls)


# ------------------------------------------------------------------------------------------------
# packing


def unpadded_rows(batch):
    lengths = batch["attention_mask"].sum(-1).tolist()
    return [{key: batch[key][b, :n] for key in ("input_ids", "loss_mask")}
            for b, n in enumerate(lengths)]


@pytest.mark.parametrize("version", [1, 3])
def test_packing_gives_the_unpacked_loss_metrics_and_gradients(version):
    """Three rows end to end in one row (features computed by the target per document) give the
    padded batch's summed loss, metrics and gradients; the same row without position_ids (one
    long document) does not."""
    target = make_target()
    head = make_head(target, version)
    padded = with_features(target, head, make_batch(target, lengths=(23, 17, 9)))
    packed = pack_rows(unpadded_rows(padded))
    assert packed["input_ids"].shape == (1, 49) and packed["position_ids"][0, 23] == 0
    packed.update(ttt_features(target, head, packed))
    # no feature noise: it is drawn over the batch's shape, which packing changes
    options = dict(steps=4, chunk_size=7, reduction="sum", feature_noise=0.0)
    expected, expected_metrics = eagle_loss(head, padded, **options)
    want = grads(head, expected)
    loss, metrics = eagle_loss(head, packed, **options)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    for key, value in expected_metrics.items():
        torch.testing.assert_close(metrics[key].double(), value.double(), rtol=1e-10,
                                   atol=1e-10, msg=key)
    for name, grad in grads(head, loss).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-9, atol=1e-10, msg=name)
    one_document = {k: v for k, v in packed.items() if k != "position_ids"}
    one_document.update(ttt_features(target, head, one_document))
    wrong, _ = eagle_loss(head, one_document, **options)
    assert abs(float(wrong) - float(expected)) > 1e-3


def ttt_features(target, head, batch):
    from draftsmith.targets.features import target_features

    return target_features(target, batch["input_ids"], batch["attention_mask"], head.config,
                           position_ids=batch.get("position_ids"))


def grads(head, loss):
    head.zero_grad()
    loss.backward(retain_graph=True)
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def test_packed_rows_predict_nothing_across_documents():
    """Every row scored wholly (loss mask all ones, even on a row's first tokens): the packed
    row's summed loss and scored positions are the rows' own, added; read as one long document
    it attends and predicts across the boundary too, and its loss differs (the control)."""
    target = make_target()
    head = make_head(target, 3)
    rows = [{"input_ids": torch.arange(1, 11), "loss_mask": torch.ones(10, dtype=torch.long)},
            {"input_ids": torch.arange(20, 26), "loss_mask": torch.ones(6, dtype=torch.long)}]

    def summed(batch):
        batch = {**batch, **ttt_features(target, head, batch)}
        loss, metrics = eagle_loss(head, batch, steps=3, chunk_size=4, reduction="sum")
        return float(loss), int(metrics["tokens"])

    separate = [summed(pack_rows([row])) for row in rows]
    packed = summed(pack_rows(rows))
    assert packed[0] == pytest.approx(sum(loss for loss, _ in separate), rel=1e-12)
    assert packed[1] == sum(tokens for _, tokens in separate)
    joined = {k: v for k, v in pack_rows(rows).items() if k != "position_ids"}
    assert summed(joined)[0] != pytest.approx(packed[0], rel=1e-3)
