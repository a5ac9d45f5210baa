"""Sharding, through torch's own engines: the trained module under FSDP2, its checkpoints through
``torch.distributed.checkpoint``, and the device mesh the frozen target is sharded over.

Which engine trains the module is the launch's choice, as accelerate's configs say it:
``configs/accelerate/multi_gpu.yaml`` (DDP, the default: every process holds the whole trained
module) or ``configs/accelerate/fsdp2.yaml`` (accelerate's FSDP plugin with ``fsdp_version: 2``:
the module's weights, gradients and AdamW state are split over the processes). accelerate turns
FSDP on only for GPU jobs; the module is sharded here, with ``fully_shard``, wherever the launch
asks for FSDP2 (the same code on a GPU and on CPU processes, where the tests run it), and is then
never handed to ``accelerator.prepare``: accelerate keeps the processes, precision, accumulation
and random states, torch the sharding and its checkpoints.

The frozen target is sharded by the training config (``target_parallel``: how many processes
hold one copy of it between them), over a 2-D mesh ``(replicate, shard)`` of
``(processes / target_parallel, target_parallel)``: each group of ``target_parallel`` processes
holds one copy, every process keeps its own batch (targets/shards.py).

Checkpoints of an FSDP2 run hold the module and optimizer in ``dcp/`` (``torch.distributed
.checkpoint``: one file per process plus ``.metadata``), which loads at any number of processes;
a run on one process without a process group keeps its module whole and reads and writes the
same layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

DCP_DIR = "dcp"  # inside a checkpoint of an FSDP2 run
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards: a pickle
REPLICATED, FSDP2 = "replicated", "fsdp2"  # how a checkpoint holds the trained module


@dataclass(frozen=True)
class ShardingPlan:
    """What a run shards: the trained module (``trained``: replicated, i.e. DDP or one process,
    or fsdp2) and the frozen target (over ``target_parallel`` processes)."""

    trained: str = REPLICATED
    target_parallel: int = 1
    reshard_after_forward: bool = True
    bf16: bool = False  # FSDP2's compute dtype for the trained module (reductions stay fp32)

    @property
    def shards_target(self) -> bool:
        return self.target_parallel > 1

    @property
    def any(self) -> bool:
        return self.trained == FSDP2 or self.shards_target


def launch_fsdp() -> tuple[int, bool] | None:
    """(FSDP version, reshard after forward) when the launch asks for FSDP (what ``accelerate
    launch`` exports from a config with ``distributed_type: FSDP``), else None."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    version = int(os.environ.get("FSDP_VERSION", "1"))
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in (
        "false", "no_shard", "shard_grad_op")
    return version, reshard


def run_plan(cfg, accelerator) -> ShardingPlan:
    """The run's sharding plan, computed once (by :func:`draftsmith.train.loop.start_run`, before
    anything loads) and carried on the run's accelerator: every later reader gets that object."""
    plan = getattr(accelerator, "draftsmith_sharding_plan", None)
    if plan is None:
        plan = sharding_plan(cfg, accelerator)
        accelerator.draftsmith_sharding_plan = plan
    return plan


def sharding_plan(cfg, accelerator) -> ShardingPlan:
    """The run's plan from the launch (FSDP2 or not) and ``target_parallel``, refusing what
    cannot work with one line each (before any weight is loaded)."""
    processes = accelerator.num_processes
    target_parallel = int(cfg.target_parallel)
    if processes % target_parallel:
        raise ValueError(f"target_parallel {target_parallel} does not divide the {processes} "
                         f"processes of this launch: the mesh is (processes / target_parallel, "
                         f"target_parallel); use a divisor of {processes} (GPUs per node, say)")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ValueError("DeepSpeed is not supported: launch with configs/accelerate/fsdp2.yaml "
                         "(FSDP2 splits the trained module's weights, gradients and optimizer "
                         "state) or configs/accelerate/multi_gpu.yaml (DDP)")
    fsdp = launch_fsdp()
    trained = REPLICATED
    reshard = True
    if fsdp is not None:
        version, reshard = fsdp
        if version != 2:
            raise ValueError(f"the launch asks for FSDP version {version}; draftsmith shards with "
                             f"FSDP2 (fully_shard): set fsdp_version: 2 in the accelerate config "
                             f"(configs/accelerate/fsdp2.yaml)")
        if os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            raise ValueError("fsdp_offload_params is not supported (the trained module is small "
                             "beside the target); set it to false")
        trained = FSDP2
    bf16 = accelerator.mixed_precision == "bf16"
    return ShardingPlan(trained=trained, target_parallel=target_parallel,
                        reshard_after_forward=reshard, bf16=bf16)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_mesh(device: torch.device):
    """A 1-D mesh over every process (the trained module's FSDP2 shards), or None alone."""
    if not distributed():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def target_mesh(device: torch.device, target_parallel: int):
    """The 2-D mesh ``(replicate, shard)`` the frozen target is sharded over."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(device.type, (world // target_parallel, target_parallel),
                            mesh_dim_names=("replicate", "shard"))


def shard_trained(module: nn.Module, plan: ShardingPlan, device: torch.device) -> nn.Module:
    """``fully_shard`` the trained module over every process, as one unit: its weights are
    gathered for its forward and backward and freed after (losses read some of them outside any
    submodule's forward: a Medusa head's projection, an EAGLE layer's q/k/v, so no submodule is
    a unit of its own). bf16 compute with fp32 gradient reductions under bf16 mixed precision.
    Alone (no process group) the module stays whole."""
    mesh = world_mesh(device)
    if mesh is None:
        return module
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if plan.bf16 else MixedPrecisionPolicy()
    fully_shard(module, mesh=mesh, reshard_after_forward=plan.reshard_after_forward,
                mp_policy=policy)
    return module


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, sync: bool):
    """No gradient reduce-scatter on the micro-batches before the last of an optimizer step
    (FSDP2's counterpart of DDP's ``no_sync``)."""
    if not is_sharded(module) or sync:
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole weights (every process calls it; an FSDP2 module's shards are gathered
    onto the CPU of the main process, the others get an empty dict)."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def whole_module(module: nn.Module, build) -> nn.Module | None:
    """The trained module with its whole weights, for an export written by the main process:
    the module itself when it is not sharded; for an FSDP2 module, a fresh one from
    ``build()`` loaded with the gathered weights on the main process (None on the others).
    Every process calls it (the gather needs them all)."""
    if not is_sharded(module):
        return module
    weights = full_state_dict(module)
    if not weights:  # not the main process: cpu_offload gathers onto process 0 only
        return None
    whole = build()
    whole.load_state_dict(weights)
    return whole


def all_finite(module: nn.Module) -> bool:
    """Whether every floating weight of the module is finite on every process (one all-reduce
    for a sharded module)."""
    bad = torch.zeros((), dtype=torch.int32)
    for tensor in module.state_dict().values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local.detach()).all()):
            bad += 1
    if is_sharded(module) and distributed():
        bad = bad.to(next(module.parameters()).device)
        dist.all_reduce(bad)
    return not int(bad)


def save_sharded(module: nn.Module, optimizer, directory: Path) -> None:
    """The module's and optimizer's state into ``directory/dcp`` (every process writes its
    shards; alone, the whole of both)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             checkpoint_id=str(directory / DCP_DIR), no_dist=not distributed())


def load_sharded(module: nn.Module, optimizer, directory: Path, recorded: dict) -> None:
    """:func:`save_sharded`'s state into the module and optimizer, whatever the number of
    processes that wrote it (torch.distributed.checkpoint re-shards). ``recorded``: the
    checkpoint's trainer_state.json; its ``.metadata`` (a pickle torch unpickles) is checked
    against the digest recorded there right before torch reads it (:func:`dcp_problems` checked
    every file before the resume began)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    problems = dcp_problems(directory, recorded, only=(DCP_METADATA,))
    if problems:
        raise ValueError(f"checkpoint {directory} is not the one draftsmith wrote: "
                         f"{'; '.join(problems)}; nothing was read from it")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory / DCP_DIR), no_dist=not distributed())
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def dcp_digests(directory: Path) -> dict[str, dict]:
    """Every file of a checkpoint's ``dcp/`` -> its size and SHA-256, for trainer_state.json
    (the main process, once every process has written its shards)."""
    root = directory / DCP_DIR
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            found[path.relative_to(root).as_posix()] = {"bytes": path.stat().st_size,
                                                        "sha256": digest}
    return found


def dcp_problems(directory: Path, recorded: dict, only: tuple[str, ...] | None = None
                 ) -> list[str]:
    """What in a checkpoint's ``dcp/`` differs from the sizes and SHA-256 digests its
    trainer_state.json recorded when draftsmith saved it (``only``: these files). Nothing in
    ``dcp/`` is parsed here: its ``.metadata`` is a pickle, and draftsmith lets torch unpickle
    only the one it wrote (a crafted one runs code when read)."""
    digests = recorded.get("dcp")
    if not isinstance(digests, dict) or DCP_METADATA not in digests:
        return [f"{DCP_DIR}/ has no recorded digests (saved by a draftsmith before they were "
                f"recorded, or not by draftsmith): its {DCP_METADATA} is a pickle draftsmith "
                f"does not read unverified; resume from a checkpoint this version saved, or "
                f"start a new run"]
    root = directory / DCP_DIR
    problems = []
    for name, want in sorted(digests.items()):
        if only is not None and name not in only:
            continue
        path = root / name
        if (not isinstance(want, dict) or ".." in Path(name).parts
                or Path(name).is_absolute()):
            problems.append(f"{DCP_DIR}/{name}: a malformed digest record")
            continue
        if not path.is_file():
            problems.append(f"{DCP_DIR}/{name} is missing")
            continue
        size = path.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{DCP_DIR}/{name} is {size} bytes, {want.get('bytes')} when saved")
            continue
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != want.get("sha256"):
                problems.append(f"{DCP_DIR}/{name} differs from what was saved (its SHA-256 "
                                f"does not match the recorded one)")
    return problems


def check_shared_directory(accelerator, directory: Path, what: str) -> None:
    """Refuse a directory that is not the same one on every process (node-local disks on
    several nodes): the main process writes a token there, every process must read it back.
    One line, before the target loads; the probe is removed again."""
    if accelerator.num_processes == 1:
        return
    import secrets

    while not directory.exists() and directory != directory.parent:
        directory = directory.parent  # nothing is created: where it will be made must be shared
    from accelerate.utils import broadcast_object_list

    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    if accelerator.is_main_process:
        try:
            (directory / f".draftsmith-shared-probe-{token[0]}").write_text(token[0])
        except OSError:
            token = [None]  # not writable: the output directory's own check says so, later
    token = broadcast_object_list(token)
    if token[0] is None:
        return
    probe = directory / f".draftsmith-shared-probe-{token[0]}"
    seen = probe.read_text() if probe.is_file() else None
    flags = accelerator.gather(torch.tensor([int(seen != token[0])], device=accelerator.device))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        probe.unlink(missing_ok=True)
    missing = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if missing:
        raise ValueError(f"{what} {directory} is not shared by every process (process(es) "
                         f"{missing} do not see what process 0 wrote there): on several nodes "
                         f"give a directory on a filesystem every node mounts (NFS, Lustre, a "
                         f"shared volume)")


def check_target_shards(cfg, plan: ShardingPlan) -> None:
    """Refuse, from the target's config.json alone, more shards than its layers can be split
    into (:func:`draftsmith.targets.shards.check_shards`)."""
    if not plan.shards_target:
        return
    from draftsmith.targets.resolve import check_model_directory, resolve_target
    from draftsmith.targets.shards import check_shards

    try:
        config = check_model_directory(resolve_target(cfg.target))
    except (FileNotFoundError, ValueError, OSError):
        return  # loading the target reports it
    check_shards(config, plan.target_parallel)


def load_run_target(cfg, accelerator, *, parts_only: bool = False):
    """The frozen target a run trains against: whole on every process, its decoder layers
    sharded over the (replicate, shard) mesh when ``target_parallel`` > 1
    (:func:`draftsmith.targets.shards.load_sharded_target`), or only its embedding, norm and LM head
    (``parts_only``: a run from a finished feature cache). Never prepared."""
    from draftsmith.targets.target import load_target, load_target_parts

    device = accelerator.device
    if parts_only:
        return load_target_parts(cfg.target, device=device)
    plan = run_plan(cfg, accelerator)
    if plan.shards_target:
        from draftsmith.targets.shards import load_sharded_target

        return load_sharded_target(cfg.target, target_mesh(device, plan.target_parallel),
                                   device=device)
    return load_target(cfg.target, device=device)

