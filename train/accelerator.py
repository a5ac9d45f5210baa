"""The Accelerator a trainer runs under: processes, precision, accumulation, timeouts.

Distributed training and mixed precision enter here, through accelerate; what is sharded, and
how, is train/sharding.py (torch's FSDP2 and device meshes). A trainer calls
:func:`make_accelerator` first: it seeds every random generator before any weights exist.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate import utils as accelerate_utils
from accelerate.utils import (
    InitProcessGroupKwargs,
    ProjectConfiguration,
    parse_flag_from_env,
    set_seed,
)

from draftsmith.train.signals import follow_launcher


def _device_backend_available() -> bool:
    """Whether a device accelerate would run a multi-process job on (CUDA, XPU, NPU, ...) exists."""
    probes = ("is_xpu_available", "is_npu_available", "is_mlu_available", "is_sdaa_available",
              "is_musa_available", "is_hpu_available", "is_neuron_available",
              "is_torch_xla_available")
    return torch.cuda.is_available() or any(getattr(accelerate_utils, name)() for name in probes)


def launched_on_cpu() -> bool:
    """True for a multi-process launch (torchrun sets LOCAL_RANK) on a machine without a device.

    accelerate then needs ``cpu=True`` to set up gloo (MULTI_CPU); without it every process
    would run alone and they would all write the same checkpoints.
    """
    return int(os.environ.get("LOCAL_RANK", -1)) != -1 and not _device_backend_available()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX), where bf16 autocast pays.

    Without those instructions bf16 matrix products are emulated: on an AVX2-only AMD EPYC a
    (2048 x 576) @ (576 x 1536) product took 6x longer in bf16 than in fp32.
    """
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_mixed_precision(setting: str, cpu: bool = False) -> str:
    """``auto`` -> bf16 on a CUDA device (fp16 where bf16 is unsupported), bf16 on a CPU with
    native bf16 instructions (:func:`cpu_has_bf16`), ``no`` (fp32) elsewhere.

    The training config decides, not ``accelerate launch``: the launcher always exports a
    precision (``no`` when its config file names none), which would silently turn bf16 off.
    """
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and not cpu and not parse_flag_from_env("ACCELERATE_USE_CPU"):
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_bf16() else "no"


def make_accelerator(cfg) -> Accelerator:
    """The run's Accelerator (precision, accumulation, trackers, project dir, the process group's
    timeout), then the seed.

    Call it first: the seed must be set before the head is built so that its initialisation is
    the same on every process and in every rerun; a process started by ``accelerate launch``
    then also stops when its launcher is stopped (:func:`draftsmith.train.signals.follow_launcher`). ``dist_timeout_minutes`` bounds how long a
    collective waits for a slow process (NCCL's default is 10 minutes).
    """
    follow_launcher()  # SIGTERM to `accelerate launch` alone reaches this process too
    cpu = launched_on_cpu()
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=resolve_mixed_precision(cfg.mixed_precision, cpu),
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                            logging_dir=cfg.output_dir),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(
            timeout=timedelta(minutes=cfg.dist_timeout_minutes))],
    )
    set_seed(cfg.seed)
    return accelerator


def attention_kernels(cfg):
    """The SDPA kernels a training step may use: all of them, or with ``fused_attention_only``
    the fused ones alone (flash, memory-efficient, cuDNN), so that a fall-back to the math
    kernel fails loudly instead of materialising (B, H, n, n) scores."""
    if not cfg.fused_attention_only:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.CUDNN_ATTENTION])


def close_process_group(accelerator: Accelerator | None = None) -> None:
    """The end of a run: the trackers closed and the process group destroyed (every process).

    A gloo process group is destroyed but its object is kept alive until the process exits. On
    torch 2.13 its C++ destructor joins gloo's worker threads while the thread dropping the last
    reference holds the GIL, and a worker that is still freeing a finished collective (a barrier
    keeps the collectives before it, whose tensors belong to Python objects) waits for the GIL:
    the process then hangs for ever after training ended. Two CPU processes hung so 2 times in 26
    launches on a busy 2-core machine, the last reference dropped with DDP's reducer when the
    trainer returned; none did in 40 launches with the group kept.
    The same worker must also be done before the interpreter finalizes: a thread that asks for the
    GIL then is ended by Python mid-C++, and the process aborts ("terminate called without an
    active exception", once in a CI run of two FSDP2 processes). So the GIL is released for a
    moment at the end, for any freeing still under way. The worker threads, idle by then, end with
    the process; NCCL groups are left to torch.
    """
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    gloo = group is not None and dist.get_backend(group) == "gloo"
    if gloo:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed: see above
    if accelerator is not None:
        accelerator.end_training()
    elif group is not None:
        dist.destroy_process_group()
    if gloo:
        time.sleep(0.2)  # the GIL released: gloo's workers finish freeing (see above)
