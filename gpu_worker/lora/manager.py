"""The adapters one worker holds: loading, sharding for its rank, and the mapping of each step's
tokens to them.

Loaded adapters are kept in host memory, sharded for this rank (a rank-16 adapter on every
projection of SmolLM2-135M is about 5 MB in fp32): all of them, or with ``max_cpu`` (vLLM's
``--max-cpu-loras``) at most that many, the least recently used dropped first; an adapter a step
needs that was dropped is read from its checkpoint again. On an accelerator at most ``max_resident`` of them
(``--max-loras``, the most one step may use, which the scheduler enforces) are on the device at a
time: a step's adapters are copied in before its forward, replacing the least recently used ones
it does not need, as vLLM's LoRA slots do. On the CPU the host copy is the one computed with.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from engine_core.outputs import LoRARequest
from gpu_worker.layers.fused_moe import ALL_EXPERTS, DOWN, GATE, UP, FusedMoE
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.lora.experts import ExpertsLoRA
from gpu_worker.lora.layers import AdapterShard, LoRABatch, LoRALinear, Rows
from gpu_worker.lora.peft_adapter import TARGET_MODULES, PeftAdapter, load_peft_adapter
from gpu_worker.weights import EXPERT_PROJECTIONS, STACKED_EXPERT_PROJECTIONS

logger = logging.getLogger(__name__)


def _full_output_size(base: ColumnParallelLinear, shard_id: int | str | None) -> int:
    """Outputs of the whole (unsharded) sub-projection ``shard_id`` of a column-parallel layer."""
    if isinstance(base, QKVParallelLinear):
        heads = base.total_num_heads if shard_id == "q" else base.total_num_kv_heads
        return heads * base.head_dim
    if isinstance(base, MergedColumnParallelLinear):
        return base.output_sizes[int(shard_id)]
    return base.output_size


# An MoE block's layers every rank holds whole that adapters may train: its router, and Qwen2-MoE's
# shared expert's gate (plain nn.Linear layers beside the block's FusedMoE ``experts``).
_ROUTER_NAMES = ("gate", "shared_expert_gate")


def wrap_model(model: nn.Module, batch: LoRABatch) -> dict[str, LoRALinear]:
    """Replace the model's projections that adapters may train by LoRA wrappers (after the weights
    are loaded: parameter names keep their checkpoint form until then): those of the names adapters
    train in every model, those a layer names in its ``lora_targets`` (a recurrent mixer's in_proj
    and out_proj), and an MoE block's router. Returns them by path."""
    targets = set(TARGET_MODULES) | {fused for fused, _ in getattr(model, "packed_modules_mapping", {}).values()}
    wrapped: dict[str, LoRALinear] = {}
    for path, module in list(model.named_modules()):
        name = path.rsplit(".", 1)[-1]
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            wrap = name in targets or name in getattr(parent, "lora_targets", ())
        else:
            wrap = (type(module) is nn.Linear and name in _ROUTER_NAMES
                    and isinstance(getattr(parent, "experts", None), FusedMoE))
        if wrap:
            wrapper = LoRALinear(module, path, batch)
            setattr(parent, name, wrapper)
            wrapped[path] = wrapper
    return wrapped


def wrap_experts(model: nn.Module, batch: LoRABatch) -> dict[str, FusedMoE]:
    """Give each of the model's routed-experts layers its adapters' deltas; returns them by path."""
    experts = {}
    for path, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.lora = ExpertsLoRA(path, batch)
            experts[path] = module
    return experts


def adapter_module_names(model: nn.Module) -> Callable[[str], str | None]:
    """Our name of each module an adapter's checkpoint names, or None for one the model leaves out.

    PEFT names an adapter's modules as the model it was trained on has them: for a vision-language
    checkpoint served as its language model (Gemma 3 4B+), ``model.language_model.layers.0...``, and
    with a plain target list (``["q_proj", "v_proj"]``) the vision tower's projections of those names
    too. They are renamed, or left out, by the model's own tables for its checkpoint's tensors, so an
    adapter's names always follow the base weights'."""
    language_prefixes = getattr(model, "_LANGUAGE_MODEL_PREFIXES", ())
    left_out = getattr(model, "_VISION_PREFIXES", ())
    # (A model naming modules otherwise than its checkpoint: Llama 4's feed_forward is our mlp.)
    renamed = getattr(model, "lora_module_name", lambda module: module)

    def ours(module: str) -> str | None:
        if left_out and module.startswith(left_out):
            return None
        for theirs, mine in language_prefixes:
            if module.startswith(theirs):
                return renamed(mine + module[len(theirs):])
        return renamed(module)

    return ours


def _sub_projections(base: ColumnParallelLinear) -> list[int | str | None]:
    """The shard ids of a column-parallel layer's fused parts, in its weight's order ([None]: not fused)."""
    if isinstance(base, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(base, MergedColumnParallelLinear):
        return list(range(len(base.output_sizes)))
    return [None]


def _padded_rank(rank: int) -> int:
    """An expert stack's rank columns: a multiple of 8 (grouped_mm's rows must be 16-byte multiples wide)."""
    return -(-rank // 8) * 8


def _copy_whole_experts(moe: FusedMoE, into: torch.Tensor, loaded: torch.Tensor, expert: int, size: int,
                        what: str) -> None:
    """An adapter's A (or B) of one expert ([R, size] / [size, R]), or of every expert ([experts, ...]),
    whose ``size`` dimension is not split over ranks: into this rank's experts in ``into``."""
    dim = -1 if what.startswith("lora_A") else -2
    if loaded.shape[dim] != size:
        raise ValueError(f"{what} are {loaded.shape[dim]}, the experts' {size}")
    if expert == ALL_EXPERTS:
        if loaded.shape[0] != moe.num_experts:
            raise ValueError(f"it has {loaded.shape[0]} experts, the layer {moe.num_experts}")
        into.copy_(loaded.narrow(0, moe.first_expert, moe.num_local_experts))
        return
    if not 0 <= expert < moe.num_experts:
        raise ValueError(f"expert {expert} is out of range: the layer has {moe.num_experts}")
    local = expert - moe.first_expert
    if 0 <= local < moe.num_local_experts:  # (else another rank's expert)
        into[local].copy_(loaded)


class LoRAManager:
    def __init__(self, model: nn.Module, max_lora_rank: int, device: torch.device, dtype: torch.dtype,
                 max_resident: int | None = None, max_cpu: int | None = None) -> None:
        self.batch = LoRABatch()
        self.layers = wrap_model(model, self.batch)
        self.experts = wrap_experts(model, self.batch)
        self.packed: dict[str, tuple[str, int | str]] = dict(getattr(model, "packed_modules_mapping", {}))
        # A model whose base weights' rows were reordered at load reorders an adapter's B alike (DeepSeek).
        self._b_rows: Callable[[str, torch.Tensor], torch.Tensor] = getattr(model, "lora_b_rows", lambda _m, b: b)
        # A model whose checkpoint stacks its experts [experts, in, out] (Llama 4's).
        self._stacked_experts_in_out = getattr(model, "lora_stacked_experts_in_out", False)
        self.module_names = adapter_module_names(model)
        # Under pipeline parallelism, the layers other stages hold (their adapter weights are theirs).
        self.pp_missing_prefixes: tuple[str, ...] = tuple(getattr(model, "pp_missing_prefixes", ()))
        self.max_lora_rank = max_lora_rank
        self.device = device
        self.dtype = dtype
        # Every adapter added (until removed), and those loaded in memory, least recently used first.
        self.registered: dict[int, LoRARequest] = {}
        self.adapters: OrderedDict[int, AdapterShard] = OrderedDict()
        self.max_cpu = max_cpu
        self.num_loads = 0
        # None: every adapter is computed with where it is loaded. Else: the host copies, and the
        # adapters now on the device, least recently used first.
        self.max_resident = max_resident
        self._host: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._resident: OrderedDict[int, None] = OrderedDict()
        self.num_copies_in = 0

    # -- registry -------------------------------------------------------------------------------

    def add_adapter(self, lora: LoRARequest) -> bool:
        """Load and shard the adapter; False if this id is already held (with the same name and path).
        Raises ValueError for a checkpoint that cannot be served on this model."""
        held = self.registered.get(lora.lora_int_id)
        if held is not None:
            if (held.lora_name, held.lora_path) != (lora.lora_name, lora.lora_path):
                raise ValueError(f"LoRA id {lora.lora_int_id} is already {held.lora_name!r} ({held.lora_path})")
            return False
        self._load(lora, in_use=set())
        self.registered[lora.lora_int_id] = lora
        return True

    def _load(self, lora: LoRARequest, in_use: set[int]) -> AdapterShard:
        """Read, check and shard the checkpoint, making room under ``max_cpu`` by dropping the least
        recently used adapters that are not ``in_use`` (they are read again when next needed)."""
        peft = load_peft_adapter(lora.lora_path, self.max_lora_rank, self.module_names)
        if peft.skipped and lora.lora_int_id not in self.registered:  # (not again when read again)
            # As vLLM: LoRA on a multimodal model's vision tower and projector is ignored with a warning.
            logger.warning("LoRA adapter %s (%s): its %d modules in the vision tower or multimodal projector are "
                           "ignored (only the language model is served): %s", lora.lora_name, lora.lora_path,
                           len(peft.skipped), ", ".join(peft.skipped))
        adapter = self._shard(lora, peft)
        if self.max_resident is not None:  # on the device only while steps use it
            pin = self.device.type == "cuda"
            self._host[lora.lora_int_id] = {path: (a.pin_memory() if pin else a, b.pin_memory() if pin else b)
                                            for path, (a, b) in adapter.layers.items()}
            adapter.layers = {}
        else:
            adapter.layers = {path: (a.to(self.device), b.to(self.device)) for path, (a, b) in adapter.layers.items()}
        if self.max_cpu is not None:
            while len(self.adapters) >= self.max_cpu:
                victim = next((i for i in self.adapters if i not in in_use), None)
                if victim is None:
                    raise RuntimeError(f"a step uses more than max_cpu_loras={self.max_cpu} adapters")
                self._unload(victim)
        self.adapters[lora.lora_int_id] = adapter
        self.num_loads += 1
        return adapter

    def _unload(self, lora_int_id: int) -> bool:
        self._host.pop(lora_int_id, None)
        self._resident.pop(lora_int_id, None)
        return self.adapters.pop(lora_int_id, None) is not None

    def remove_adapter(self, lora_int_id: int) -> bool:
        self._unload(lora_int_id)
        return self.registered.pop(lora_int_id, None) is not None

    def full_rank_layers(self, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Zeros of the shapes an adapter of rank max_lora_rank on everything adapters may train holds
        on this rank, as ``_shard`` lays them out: every wrapped projection (a fused one's parts each of
        that rank), the routers, and every routed experts layer (its gate and up projections each of that
        rank, or their stack of twice it)."""
        rank = self.max_lora_rank
        layers = {}
        for path, wrapper in self.layers.items():
            base = wrapper.base
            dtype = self.dtype
            if isinstance(base, RowParallelLinear):
                inputs, outputs, columns = base.input_size_per_partition, base.output_size, rank
            elif isinstance(base, ColumnParallelLinear):
                columns = len(_sub_projections(base)) * rank
                inputs, outputs = base.input_size, base.output_size_per_partition
            else:  # (a router: its own dtype)
                inputs, outputs, columns, dtype = base.in_features, base.out_features, rank, base.weight.dtype
            layers[path] = (torch.zeros(inputs, columns, dtype=dtype, device=device),
                            torch.zeros(columns, outputs, dtype=dtype, device=device))
        for path, moe in self.experts.items():
            experts, hidden, width = moe.num_local_experts, moe.hidden_size, moe.intermediate_size_per_partition
            gate_up, down = _padded_rank(2 * rank), _padded_rank(rank)
            layers[f"{path}.w13_weight"] = (
                torch.zeros(experts, gate_up, hidden, dtype=self.dtype, device=device),
                torch.zeros(experts, moe.gate_up_rows, gate_up, dtype=self.dtype, device=device))
            layers[f"{path}.w2_weight"] = (torch.zeros(experts, down, width, dtype=self.dtype, device=device),
                                           torch.zeros(experts, hidden, down, dtype=self.dtype, device=device))
        return layers

    def adapter_bytes_bound(self) -> int:
        """The most bytes one adapter holds on this rank (``full_rank_layers``')."""
        return sum(t.numel() * t.element_size() for pair in self.full_rank_layers(torch.device("meta")).values()
                   for t in pair)

    def set_profile_batch(self) -> None:
        """Every row of the next pass under an adapter of ``full_rank_layers`` on the device (the
        memory profile's pass: its peak holds one adapter and every delta's temporaries), where
        adapters are copied to the device; else under none. ``set_batch`` drops it."""
        groups: list[tuple[AdapterShard, Rows]] = []
        if self.max_resident is not None:
            groups = [(AdapterShard(-1, "profile", "", self.full_rank_layers(self.device)), None)]
        self.batch.set_groups(groups)

    def device_bytes_reserved(self) -> int:
        """What the adapters on the device may take beyond the one the profiled pass held
        (``set_profile_batch``): ``max_resident`` adapters, each at most ``adapter_bytes_bound``. Kept
        out of the KV cache's share; 0 where adapters are computed with where they are loaded (the CPU)."""
        return 0 if self.max_resident is None else (self.max_resident - 1) * self.adapter_bytes_bound()

    def resident_adapters(self) -> list[int]:
        """The adapters now on the device (all of them when there is no limit)."""
        return list(self._resident) if self.max_resident is not None else sorted(self.adapters)

    def _make_resident(self, adapter: AdapterShard, in_use: set[int]) -> None:
        lora_id = adapter.lora_int_id
        if lora_id in self._resident:
            self._resident.move_to_end(lora_id)
            return
        while len(self._resident) >= self.max_resident:  # type: ignore[operator]
            victim = next((i for i in self._resident if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.max_resident} adapters")
            del self._resident[victim]
            self.adapters[victim].layers = {}
        adapter.layers = {path: (a.to(self.device, non_blocking=True), b.to(self.device, non_blocking=True))
                          for path, (a, b) in self._host[lora_id].items()}
        self._resident[lora_id] = None
        self.num_copies_in += 1

    def release_device_copies(self) -> None:
        """Drop the adapters' device copies (sleep mode): the host copies stay, and a step copies in
        what it needs again. (Nothing to drop where adapters are computed with where they are loaded.)"""
        if self.max_resident is None:
            return
        for lora_id in self._resident:
            self.adapters[lora_id].layers = {}
        self._resident.clear()

    def list_adapters(self) -> list[int]:
        return sorted(self.registered)

    def loaded_adapters(self) -> list[int]:
        """The adapters in memory now, least recently used first."""
        return list(self.adapters)

    # -- per step -------------------------------------------------------------------------------

    def set_batch(self, lora_ids: list[int], query_start_loc: np.ndarray) -> None:
        """``lora_ids[i]``: request i's adapter (0: none); its tokens are rows
        ``query_start_loc[i]:query_start_loc[i + 1]`` of the step's flat batch."""
        # (The last pass's adapters let go first: a device copy dropped since, by eviction or removal,
        # is freed before this pass's are copied in.)
        self.batch.set_groups([])
        groups: list[tuple[AdapterShard, Rows]] = []
        if any(lora_ids):
            ids = np.asarray(lora_ids, dtype=np.int64)
            in_use = set(np.unique(ids[ids > 0]).tolist())
            for lora_id in sorted(in_use):
                adapter = self.adapters.get(lora_id)
                if adapter is None:
                    lora = self.registered.get(lora_id)
                    if lora is None:
                        raise KeyError(f"LoRA adapter {lora_id} is not loaded on this worker")
                    adapter = self._load(lora, in_use)  # dropped under max_cpu_loras: read it again
                self.adapters.move_to_end(lora_id)
                if self.max_resident is not None:
                    self._make_resident(adapter, in_use)
                reqs = np.flatnonzero(ids == lora_id)
                rows: Rows = None
                if len(reqs) < len(ids):
                    # Runs of consecutive requests, each one slice of rows.
                    breaks = np.flatnonzero(np.diff(reqs) != 1) + 1
                    rows = [slice(int(query_start_loc[run[0]]), int(query_start_loc[run[-1] + 1]))
                            for run in np.split(reqs, breaks)]
                groups.append((adapter, rows))
        self.batch.set_groups(groups)

    # -- sharding -------------------------------------------------------------------------------

    def _shard(self, lora: LoRARequest, peft: PeftAdapter) -> AdapterShard:
        # Our path of each trained projection -> {shard id (None when not fused): (A, B)}.
        by_layer: dict[str, dict[int | str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Our path of each routed-experts layer trained -> (expert or ALL_EXPERTS, projection, A, B).
        by_experts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in peft.weights.items():
            experts = self._experts_projection(module)
            if experts is not None and experts[1] == ALL_EXPERTS and self._stacked_experts_in_out:
                # (PEFT's [experts, out, in] reading of an [experts, in, out] stack: its A takes the outputs.)
                a, b = b.transpose(1, 2), a.transpose(1, 2)
            b = self._b_rows(module, b.float()) * peft.scaling_of(module)
            if experts is not None:
                path, expert, projection = experts
                by_experts.setdefault(path, []).append((expert, projection, a.float(), b))
                continue
            prefix, _, name = module.rpartition(".")
            # (A projection of its own name is not a shard: an ungated MLP's up_proj, Arcee's.)
            fused, shard_id = (name, None) if module in self.layers else self.packed.get(name, (name, None))
            path = f"{prefix}.{fused}" if prefix else fused
            if path not in self.layers and f"{path}.".startswith(self.pp_missing_prefixes):
                continue  # (a layer another pipeline stage holds: its own rank loads this part)
            if path not in self.layers:
                raise ValueError(f"LoRA adapter {lora.lora_path}: the model has no projection {module!r}")
            by_layer.setdefault(path, {})[shard_id] = (a.float(), b)
        layers = {}
        for path, subs in by_layer.items():
            base = self.layers[path].base
            try:
                if isinstance(base, RowParallelLinear):
                    a, b = self._row_parallel(base, subs[None])
                elif isinstance(base, ColumnParallelLinear):
                    a, b = self._column_parallel(base, subs)
                else:  # (a layer every rank holds whole: a router)
                    a, b = self._whole(base, subs[None])
            except (ValueError, RuntimeError, IndexError) as e:
                raise ValueError(f"LoRA adapter {lora.lora_path}: its weights for {path} do not fit the model "
                                 f"({e})") from None
            # (On the host here: add_adapter places them. A router computed in fp32 takes them so.)
            dtype = base.weight.dtype if type(base) is nn.Linear else self.dtype
            layers[path] = (a.t().contiguous().to(dtype), b.t().contiguous().to(dtype))
        for path, pieces in by_experts.items():
            try:
                layers.update(self._experts_stacks(path, self.experts[path], pieces, self.dtype, self.max_lora_rank))
            except (ValueError, RuntimeError, IndexError) as e:
                raise ValueError(f"LoRA adapter {lora.lora_path}: its weights for the routed experts {path} do not "
                                 f"fit the model ({e})") from None
        return AdapterShard(lora.lora_int_id, lora.lora_name, lora.lora_path, layers)

    def _experts_projection(self, module: str) -> tuple[str, int, int] | None:
        """(our routed-experts layer, expert or ALL_EXPERTS, projection) an adapter's module trains
        (``<experts>.gate_up_proj``: every expert's gate and up projections, as their weights load), or
        None for a module that is not one of the experts' projections."""
        prefix, _, name = module.rpartition(".")
        if prefix in self.experts and name in STACKED_EXPERT_PROJECTIONS:  # (a stacked parameter of every expert)
            return prefix, ALL_EXPERTS, STACKED_EXPERT_PROJECTIONS[name][1]
        experts, _, index = prefix.rpartition(".")
        if experts in self.experts and index.isdigit() and name in EXPERT_PROJECTIONS:
            return experts, int(index), EXPERT_PROJECTIONS[name][1]
        return None

    @staticmethod
    def _experts_stacks(path: str, moe: FusedMoE, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]],
                        dtype: torch.dtype, max_lora_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's (A [local experts, R, in], B [local experts, out, R]) stacks for the experts'
        gate/up and down projections, sharded as the experts' weights are: each rank's slice of every
        expert's width (B's gate and up rows, down's A columns, put in place by the experts' own
        weight loader), or under expert parallelism its own experts whole. Each kind of piece (every
        expert's stacked projection, or one expert's gate, up or down projection) has its own
        columns of R, so gate and up trained apart keep apart (block diagonal B)."""
        hidden, width = moe.hidden_size, moe.intermediate_size_per_partition
        # The most rank columns of the gate/up and the down stacks (full_rank_layers': the memory kept).
        bound = (_padded_rank(2 * max_lora_rank), _padded_rank(max_lora_rank))
        stacks = {}
        for key, projections, a_width, b_rows in ((f"{path}.w13_weight", (GATE, UP), hidden, moe.gate_up_rows),
                                                  (f"{path}.w2_weight", (DOWN,), width, hidden)):
            mine = [piece for piece in pieces if piece[1] in projections]
            if not mine:
                continue
            columns: dict[tuple[bool, int], int] = {}  # each kind of piece -> its rank
            for expert, projection, a, _ in mine:
                kind = (expert == ALL_EXPERTS, projection)
                columns[kind] = max(columns.get(kind, 0), a.shape[-2])
            starts = dict(zip(columns, np.cumsum([0, *columns.values()]).tolist(), strict=False))
            rank = _padded_rank(sum(columns.values()))
            if rank > bound[DOWN in projections]:  # (one form of the experts' adapter, or the other, fits)
                raise ValueError(f"its pieces on the experts' {'down' if DOWN in projections else 'gate/up'} "
                                 f"projections take rank {sum(columns.values())}, above what --max-lora-rank "
                                 f"{max_lora_rank} allows ({bound[DOWN in projections]})")
            a_stack = torch.zeros(moe.num_local_experts, rank, a_width)
            b_stack = torch.zeros(moe.num_local_experts, b_rows, rank)
            for expert, projection, a, b in mine:
                start = starts[(expert == ALL_EXPERTS, projection)]
                cols = slice(start, start + a.shape[-2])
                if projection == DOWN:  # A's inputs are the experts' width: this rank's columns
                    moe.weight_loader(a_stack[:, cols], a, (expert, DOWN))
                    _copy_whole_experts(moe, b_stack[:, :, cols], b, expert, hidden, "lora_B's outputs")
                else:  # B's outputs are the gate / up rows: this rank's
                    _copy_whole_experts(moe, a_stack[:, cols], a, expert, hidden, "lora_A's inputs")
                    moe.weight_loader(b_stack[:, :, cols], b, (expert, projection))
            stacks[key] = (a_stack.to(dtype), b_stack.to(dtype))
        return stacks

    @staticmethod
    def _whole(base: nn.Linear, ab: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ab
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
            raise ValueError(f"lora_A has {a.shape[1]} inputs and lora_B {b.shape[0]} outputs, the layer "
                             f"{base.in_features} and {base.out_features}")
        return a, b

    @staticmethod
    def _row_parallel(base: RowParallelLinear, ab: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ab
        inputs = base.input_size_per_partition * base.tp_size
        if a.shape[1] != inputs:
            raise ValueError(f"lora_A has {a.shape[1]} inputs, the layer {inputs}")
        a_part = torch.empty(a.shape[0], base.input_size_per_partition, dtype=a.dtype)
        base.weight_loader(a_part, a)  # this rank's input columns
        if b.shape[0] != base.output_size:
            raise ValueError(f"lora_B has {b.shape[0]} rows, the layer {base.output_size} outputs")
        return a_part, b

    @staticmethod
    def _column_parallel(base: ColumnParallelLinear, subs: dict[int | str | None, tuple[torch.Tensor, torch.Tensor]]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """A: the trained sub-projections' A stacked ([R, in]); B: [out slice, R], each sub's
        columns holding its B rows for this rank where the fused weight holds that sub. An adapter
        trained on the fused projection itself (Phi-3's ``qkv_proj``, shard id None) has one A, and
        its B's rows are cut into the subs, each placed as the base weight's rows are. A projection
        whose weight picks this rank's rows with a loader of its own (a recurrent mixer's in_proj: its
        rank's rows of each part) has its B's rows picked by that loader, B as many rows as the
        checkpoint's weight (``checkpoint_rows``)."""
        own_loader = getattr(base.weight, "weight_loader", None)
        if own_loader is not None and own_loader != base.weight_loader and set(subs) == {None}:
            a, whole_b = subs[None]
            if a.shape[1] != base.input_size:
                raise ValueError(f"lora_A has {a.shape[1]} inputs, the layer {base.input_size}")
            rows = getattr(base.weight, "checkpoint_rows", None)
            if rows is None or whole_b.shape[0] != rows:
                raise ValueError(f"lora_B has {whole_b.shape[0]} outputs, the layer {rows}")
            b = torch.zeros(base.output_size_per_partition, a.shape[0], dtype=a.dtype)
            own_loader(b, whole_b)
            return a, b
        order = _sub_projections(base)
        if None in subs and order != [None]:
            if len(subs) > 1:
                raise ValueError("it trains the fused projection and its parts")
            a, whole_b = subs[None]
            if a.shape[1] != base.input_size:
                raise ValueError(f"lora_A has {a.shape[1]} inputs, the layer {base.input_size}")
            sizes = [_full_output_size(base, s) for s in order]
            if whole_b.shape[0] != sum(sizes):
                raise ValueError(f"lora_B has {whole_b.shape[0]} outputs, the fused layer {sum(sizes)}")
            b = torch.zeros(base.output_size_per_partition, a.shape[0], dtype=a.dtype)
            for s, part in zip(order, whole_b.split(sizes), strict=True):
                base.weight_loader(b, part, s)
            return a, b
        present = [s for s in order if s in subs]
        if len(present) != len(subs):
            raise ValueError(f"unexpected sub-projections {sorted(map(str, set(subs) - set(present)))}")
        for s in present:
            if subs[s][0].shape[1] != base.input_size:
                raise ValueError(f"lora_A has {subs[s][0].shape[1]} inputs, the layer {base.input_size}")
            # The whole projection's outputs (the loaders below would take a slice of a larger B).
            if subs[s][1].shape[0] != _full_output_size(base, s):
                raise ValueError(f"lora_B of {s if s is not None else 'the projection'} has {subs[s][1].shape[0]} "
                                 f"outputs, the layer {_full_output_size(base, s)}")
        a = torch.cat([subs[s][0] for s in present])
        b = torch.zeros(base.output_size_per_partition, a.shape[0], dtype=a.dtype)
        col = 0
        for s in present:
            rank = subs[s][0].shape[0]
            base.weight_loader(b[:, col:col + rank], subs[s][1], s)
            col += rank
        return a, b
