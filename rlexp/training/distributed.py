"""Several processes, one policy: FSDP2 sharding, the few collectives training needs, the local launcher,
and the sharded part of a checkpoint.

* ``shard_policy``: torch FSDP2 ``fully_shard`` on each decoder block and each vision block, then the
  root; LoRA trainable, the base frozen; on GPU bf16 compute with fp32 gradient reduction.
* ``gathered``: generation runs on the unsharded weights, so that each rank plays its own episodes for as
  many decode steps as they need, with no collective inside ``generate`` (ranks would deadlock if one
  stopped decoding before another).
* ``World.shard``: each rank takes every ``size``-th maze of the step's batch: disjoint, their union the
  single-process batch, and mini-batch ``k`` of every rank holds exactly the mazes of the single process's
  mini-batch ``k`` (see ``PolicyUpdate.mini_batches``).
* ``launch``: torch's elastic launcher (what ``torchrun`` runs) starts one process per rank from the same
  entrypoint; when one rank fails, the others are stopped and ``RankFailedError`` names the rank.
* Checkpoints: the optimizer state is saved with torch.distributed.checkpoint (one shard per rank,
  resharded on load at any world size); the adapter is consolidated into peft's format on rank 0.
"""

import datetime
import faulthandler
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: how long a rank waits for the others at a collective (rank 0 evaluates while the others wait).
TIMEOUT = datetime.timedelta(hours=2)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share: every ``size``-th item, from the ``rank``-th."""
        return list(items[self.rank :: self.size])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (the values themselves in one process)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        if not self.distributed:
            return [float(v) for v in values]
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank, on every rank."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_process_group(device: str) -> str:
    """Join the process group the launcher set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` …); the
    device this rank trains on: its local GPU, or the CPU (gloo)."""
    on_gpu = str(device).startswith("cuda")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=TIMEOUT)
    return f"cuda:{local_rank}" if on_gpu else "cpu"


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_policy(model: torch.nn.Module, on_gpu: bool) -> None:
    """FSDP2 over the peft policy, in place: each vision and decoder block is one unit, the root the rest."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else MixedPrecisionPolicy()
    inner = model.get_base_model().model
    for block in [*inner.visual.blocks, *inner.language_model.layers]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # FSDP2 sets its units up at the root's first forward; generation calls the base model's forward, below
    # the root, and would set each unit up as a root of its own, so the set-up is done here
    model._get_fsdp_state()._lazy_init()


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """The weights unsharded on every rank for the block (one all-gather per unit on entry), resharded after.

    Inside, a forward is local, so transformers' ``generate`` must not keep the ranks in step (it does, with
    an all-reduce per decode step, for modules torch marks ``_is_fsdp_managed_module``): the mark is lifted
    for the block, since rank 0 evaluates alone and ranks stop decoding at different steps. FSDP2 records
    the order units run forward in, to prefetch in backward; the block's forwards differ between ranks, so
    their record is dropped on exit (else the ranks would prefetch different units and deadlock)."""
    modules = _fsdp_modules(model)
    marked = [m for m in model.modules() if getattr(m, "_is_fsdp_managed_module", False)]
    for module in modules:
        module.unshard()
        module.set_reshard_after_forward(False)
    for module in marked:
        module._is_fsdp_managed_module = False
    try:
        yield
    finally:
        for module in marked:
            module._is_fsdp_managed_module = True
        for module in modules:
            module.set_reshard_after_forward(True)
            module.reshard()
        if modules:
            model._get_fsdp_state()._comm_ctx.post_forward_order.clear()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def this_rank(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters, full, on the CPU, by name; a collective under FSDP2."""
    return {name: local(p.detach()).cpu() for name, p in model.named_parameters() if p.requires_grad}


# -- checkpoints ------------------------------------------------------------------------------------

#: where in a checkpoint the sharded optimizer state lives.
OPTIMIZER_SHARDS = "optimizer"


def _state_options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, ignore_frozen_params=True)


def save_optimizer_shards(model, optimizer, path: Path) -> None:
    """Every rank writes its shard of the optimizer state (keyed by parameter name) under ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer, options=_state_options())}, checkpoint_id=str(path))


def load_optimizer_shards(model, optimizer, path: Path) -> None:
    """Read optimizer shards saved at any world size into this run's (resharded by DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=_state_options())}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_state_options())


def load_full_optimizer(model, optimizer, state: dict[str, Any]) -> None:
    """A single process's ``optimizer.state_dict()`` (parameters by position) into a sharded optimizer:
    positions become the trainable parameters' names, which is how the distributed state is keyed."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    keyed = {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, keyed, options=_state_options(full=True))


# -- launching --------------------------------------------------------------------------------------


class RankFailedError(RuntimeError):
    """One rank of a distributed run failed; the others were stopped. The message names the rank."""


#: lines of a crashed rank's Python stacks (``faulthandler``'s dump) that ``RankFailedError`` quotes.
FAULT_LINES = 40


def _dumping_faults(fault_dir: str, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A rank's ``entrypoint(*args)``, with ``faulthandler`` first pointed at ``<fault_dir>/rank<RANK>.txt``: a
    rank that dies of a signal (SIGABRT from C++, SIGSEGV) leaves every thread's Python stack there, and
    ``launch`` quotes it, since such a rank writes no error file and its stderr may be long gone."""
    dump = open(Path(fault_dir) / f"rank{os.environ['RANK']}.txt", "w")  # open until the process ends
    faulthandler.enable(file=dump, all_threads=True)
    return entrypoint(*args)


def _fault_dump(fault_dir: str, rank: int) -> str:
    path = Path(fault_dir) / f"rank{rank}.txt"
    dump = path.read_text(errors="replace") if path.is_file() else ""
    stacks = dump.split("\nExtension modules:")[0].strip()  # the list of loaded C modules says nothing here
    return "\n".join(stacks.splitlines()[:FAULT_LINES])


def launch(entrypoint: Callable[..., Any], nprocs: int, *args: Any) -> Any:
    """Run ``entrypoint(*args)`` in ``nprocs`` local processes, one per rank, as ``torchrun --standalone``
    would (same environment variables, same elastic agent); rank 0's return value. If any rank fails, the
    agent stops the rest and this raises ``RankFailedError`` naming the first failed rank and its error
    (for a rank killed by a signal, the Python stacks it died in, when it could still write them)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"rlexp-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2, start_method="spawn",
    )
    fault_dir = tempfile.mkdtemp(prefix="rlexp-ranks-")
    try:
        results = elastic_launch(config, _dumping_faults)(fault_dir, entrypoint, *args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        reason = failure.message if isinstance(failure.message, str) else failure.message.get("message", failure.message)
        if failure.signal_name() not in ("", "<N/A>"):
            reason = f"killed by {failure.signal_name()}"
            if stacks := _fault_dump(fault_dir, rank):
                reason += f"; its Python stacks:\n{stacks}"
        raise RankFailedError(f"rank {rank} of {nprocs} failed (exit code {failure.exitcode}): {reason}") from None
    finally:
        shutil.rmtree(fault_dir, ignore_errors=True)
    return results[0]
