"""Tensor parallelism as a transformation of a loaded model (runtime/parallel.py).

Exactness first. The single-device path computes every output element of a weight product as
one fixed-order reduction over K (numerics.row_matmul). Splitting K across ranks and
all-reducing partial sums changes that order, so this module never shards a reduction: every
element is computed wholly on one rank, and ranks exchange finished values with all-gathers
(column-parallel + gather). Tokens and logits are then bit-identical to one device, as long as
a product's rows do not depend on how many output rows (N) or query rows (M) share the call —
true of the rowwise GPU kernel and of the CPU bmm in N; in M the CPU bmm is not, so on CPU the
per-head attention products run padded to all heads (zero queries for other ranks' heads).

Per backbone layer, on rank r of W:
- attention, `heads` (default): wq_b keeps the rows of heads [r·H/W, (r+1)·H/W) (whole wo_a
  groups: H/W must be a multiple of H/G), attn_sink the same heads, wo_a those groups; the
  ranks' wo_a outputs are all-gathered (one collective) and wo_b runs whole on every rank, so
  the stream stays replicated. `replicated`: attention is not split (no collective), for when a
  collective costs more than reading the attention weights twice.
  wq_a, wkv, compressor, indexer, mHC, norms and Engram are replicated: small, and the indexer's
  selection must be the same everywhere.
- MoE: routed experts split by expert (contiguous blocks of E/W); the shared expert belongs to
  rank layer % W. Each rank computes its (token, slot) pairs, one all-gather of the per-slot
  outputs [T, k+1, D] fp32, and every rank sums the slots in slot order as the single-device
  code does.
So a step costs 2 collectives per layer (1 with replicated attention) plus the command
broadcast. The embedding is on every rank; the head, final norm and DSpark stages only on
rank 0 (sampling and drafting live there).

Loading: `sharding_reader` wraps the weight reader so experts of other ranks are never read,
and wq_b / wo_a are cut to this rank's heads as they load (stored tensors sliced at legal
boundaries, never requantized): fp8 at 32-row tiles, fp4 rows freely (groups run along K),
EXL3 at 128 channels (trellis dim 1 with svh for outputs; dim 0 with suh for inputs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from strata.config import ModelConfig
from strata.errors import ConfigError
from strata.model.attention import sparse_attention
from strata.model.model import Model
from strata.model.moe import slot_sum
from strata.model.numerics import Numerics
from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear, Linear
from strata.runtime.parallel_comm import Comm
from strata.streams import both

ATTENTION_MODES = ("heads", "replicated")


# ---- slicing stored weights -----------------------------------------------------------------
class AbsentLinear(Linear):
    """A weight another rank holds (never loaded here); using it is a bug."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise RuntimeError("this weight lives on another rank of the tensor-parallel group")

    def forward(self, *args, **kwargs):  # noqa: D102
        raise RuntimeError("this weight lives on another rank of the tensor-parallel group")

    __call__ = forward

    def nbytes(self) -> int:
        return 0


def _exl3():
    from strata.quant.exl3 import Exl3Linear
    return Exl3Linear


def _check(ok: bool, what: str, lin: Linear, lo: int, hi: int, unit: int) -> None:
    if not ok:
        raise ConfigError(f"cannot shard a {type(lin).__name__} {lin.out_features}×"
                          f"{lin.in_features} at {what} {lo}..{hi}: {type(lin).__name__} splits "
                          f"only at multiples of {unit}")


def slice_out(lin: Linear, lo: int, hi: int) -> Linear:
    """Output rows lo..hi-1 (column-parallel), as an independent Linear (own storage)."""
    if isinstance(lin, DenseLinear):
        return DenseLinear(lin.weight[lo:hi].clone())
    if isinstance(lin, (Fp8Block32Linear, Fp4Group32Linear)):
        if isinstance(lin, Fp8Block32Linear):
            _check(lo % 32 == 0 and (hi % 32 == 0 or hi == lin.out_features), "rows", lin, lo,
                   hi, 32)
            part = Fp8Block32Linear(lin.weight[lo:hi].clone(),
                                    lin.scale[lo // 32:(hi + 31) // 32].clone())
        else:
            part = Fp4Group32Linear(lin.weight[lo:hi].clone(), lin.scale[lo:hi].clone())
        # The kernels pick their split-K from the weight's shape; the slice keeps the whole
        # weight's, so its rows sum exactly as on one device.
        part.kernel_config = lin.config_of_whole()
        return part
    E = _exl3()
    if isinstance(lin, E):
        _check(lo % 128 == 0 and (hi % 128 == 0 or hi == lin.out_features), "rows", lin, lo, hi,
               128)
        hp = -(-hi // 128) * 128
        part = E(lin.trellis[:, lo // 16:hp // 16].clone(), lin.suh, lin.svh[lo:hp].clone(),
                 lin.codebook, hi - lo, lin.in_features,
                 None if lin.bias is None else lin.bias[lo:hi].clone())
        part.sched_cols = lin.sched_cols or lin.svh.numel()  # the whole weight's split order
        part.target_programs = lin.target_programs
        return part
    raise ConfigError(f"cannot shard a {type(lin).__name__} by output rows")


def slice_in(lin: Linear, lo: int, hi: int) -> Linear:
    """Input columns lo..hi-1 (row-parallel: the result is a partial sum over K). Not used by
    the exact modes; for inexact sharding and tests."""
    if isinstance(lin, DenseLinear):
        return DenseLinear(lin.weight[:, lo:hi].clone())
    if isinstance(lin, Fp8Block32Linear):
        _check(lo % 32 == 0 and (hi % 32 == 0 or hi == lin.in_features), "columns", lin, lo, hi,
               32)
        return Fp8Block32Linear(lin.weight[:, lo:hi].clone(),
                                lin.scale[:, lo // 32:(hi + 31) // 32].clone())
    if isinstance(lin, Fp4Group32Linear):
        _check(lo % 32 == 0 and hi % 32 == 0, "columns", lin, lo, hi, 32)
        return Fp4Group32Linear(lin.weight[:, lo // 2:hi // 2].clone(),
                                lin.scale[:, lo // 32:hi // 32].clone())
    E = _exl3()
    if isinstance(lin, E):
        _check(lo % 128 == 0 and (hi % 128 == 0 or hi == lin.in_features), "columns", lin, lo,
               hi, 128)
        hp = -(-hi // 128) * 128
        return E(lin.trellis[lo // 16:hp // 16].clone(), lin.suh[lo:hp].clone(), lin.svh,
                 lin.codebook, lin.out_features, hi - lo, lin.bias)
    raise ConfigError(f"cannot shard a {type(lin).__name__} by input columns")


def own_storage(lin: Linear) -> Linear:
    """The same Linear with its own tensors (a row block of a bigger one would keep the whole
    tensor alive)."""
    return slice_out(lin, 0, lin.out_features)


# ---- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TPPlan:
    rank: int
    world: int
    attention: str = "heads"

    def heads(self, cfg: ModelConfig) -> range:
        n = cfg.num_attention_heads // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def groups(self, cfg: ModelConfig) -> range:
        n = cfg.o_groups // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def experts(self, n_experts: int) -> range:
        n = n_experts // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def shared_owner(self, layer: int) -> int:
        return layer % self.world


def check_tp(cfg: ModelConfig, world: int, attention: str) -> None:
    """Raise ConfigError unless the model splits evenly over `world` ranks."""
    if attention not in ATTENTION_MODES:
        raise ConfigError(f"tensor-parallel attention {attention!r}: expected one of "
                          f"{', '.join(ATTENTION_MODES)}")
    H, G, E = cfg.num_attention_heads, cfg.o_groups, cfg.n_routed_experts
    if E % world:
        raise ConfigError(f"tensor parallelism over {world} ranks: {E} routed experts do not "
                          "split evenly")
    if attention == "heads" and (H % world or G % world):
        raise ConfigError(f"tensor parallelism over {world} ranks: {H} heads in {G} wo_a "
                          "groups do not split evenly (use --tp-attention replicated)")


_EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.w[123]$")
_WQ_B = re.compile(r"layers\.\d+\.attn\.wq_b$")
_WO_A = re.compile(r"layers\.\d+\.attn\.wo_a$")


class _Sharding:
    """Mixed into the weight reader's own class: loads only this rank's shards."""

    _tp_plan: TPPlan
    _tp_cfg: ModelConfig

    def linear(self, prefix: str, out_features: int, in_features: int) -> Linear:
        plan, cfg = self._tp_plan, self._tp_cfg
        m = _EXPERT.match(prefix)
        if m and int(m.group(2)) not in plan.experts(cfg.n_routed_experts):
            return AbsentLinear(out_features, in_features)
        lin = super().linear(prefix, out_features, in_features)
        if plan.attention == "heads" and _WQ_B.match(prefix):
            heads = plan.heads(cfg)
            return slice_out(lin, heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
        return lin

    def linear_groups(self, prefix: str, groups: int, out_per_group: int,
                      in_features: int) -> list[Linear]:
        lins = super().linear_groups(prefix, groups, out_per_group, in_features)
        if self._tp_plan.attention != "heads" or not _WO_A.match(prefix):
            return lins
        mine = self._tp_plan.groups(self._tp_cfg)
        return [own_storage(l) if g in mine else AbsentLinear(out_per_group, in_features)
                for g, l in enumerate(lins)]


@lru_cache(maxsize=None)
def _sharded_class(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (_Sharding, cls), {})


def sharding_reader(plan: TPPlan, cfg: ModelConfig):
    """ModelPart.wrap_reader for rank plan.rank: the reader keeps its class (and isinstance
    checks such as the disk-Engram one) with the sharding methods in front."""
    def wrap(w):
        w.__class__ = _sharded_class(type(w))
        w._tp_plan, w._tp_cfg = plan, cfg
        return w
    return wrap


# ---- the transformation -------------------------------------------------------------------
class GatheredInput:
    """wo_b after head-parallel attention: all-gather the ranks' wo_a outputs (their groups, in
    group order) and run the whole wo_b on every rank — each output element is the
    single-device reduction, and the stream stays replicated."""

    def __init__(self, comm: Comm, linear: Linear) -> None:
        self.comm, self.linear = comm, linear
        self.out_features, self.in_features = linear.out_features, linear.in_features

    def forward(self, x: torch.Tensor, nx: Numerics, out_dtype: torch.dtype | None = None,
                act_quant: bool = True) -> torch.Tensor:
        parts = self.comm.all_gather(x)  # [W, T, n]
        full = parts.permute(1, 0, 2).reshape(x.shape[0], -1)
        return self.linear(full, nx, out_dtype, act_quant)

    __call__ = forward


def _padded_attend(attn, heads: range, q: torch.Tensor, rows, mask,
                   out: torch.Tensor | None = None):
    """The per-head attention products with the single-device head count (CPU bmm kernels
    choose by M); the other ranks' heads are zero queries whose rows are dropped."""
    H = attn.cfg.num_attention_heads
    qp = q.new_zeros((q.shape[0], H, q.shape[2]))
    qp[:, heads.start:heads.stop] = q
    sink = attn.attn_sink.new_zeros(H)
    sink[heads.start:heads.stop] = attn.attn_sink
    o = sparse_attention(qp, rows, mask, sink, attn.cfg.head_dim ** -0.5)
    o = o[:, heads.start:heads.stop]
    return o if out is None else out.copy_(o)


class _HeldExperts:
    """A weight reader that serves already-loaded expert Linears as experts 0..n-1."""

    def __init__(self, linears: dict[str, list[Linear]]) -> None:
        self.linears = linears

    def linear(self, name: str, out_features: int, in_features: int) -> Linear:
        _, e, proj = name.rsplit(".", 2)
        lin = self.linears[proj][int(e)]
        if isinstance(lin, AbsentLinear) or (lin.out_features, lin.in_features) != \
                (out_features, in_features):
            raise RuntimeError(f"expert {name} was not loaded on this rank")
        return lin


def local_expert_stack(cfg: ModelConfig, stack, experts: range):
    """The ExpertStack of this rank's experts only (local ids 0..n-1), built by ExpertStack's
    own constructor (so the kernel paths stack exactly these experts' stored tensors)."""
    linears = {name: lins[experts.start:experts.stop] for name, lins in stack.linears.items()}
    return type(stack)(cfg, _HeldExperts(linears), "experts", len(experts))


# Up to this many (token, slot) pairs a rank computes all of them with static shapes (decode
# steps and verify windows: graphable); past it only its own (prefill chunks).
STATIC_PAIRS = 64


class ExpertParallelMoE:
    """A layer's MoE with experts split across ranks; same routing, same per-pair products,
    same slot-order sum as MoE.forward."""

    def __init__(self, cfg: ModelConfig, moe, comm: Comm, plan: TPPlan, layer: int) -> None:
        self.moe, self.comm = moe, comm
        E = moe.experts.n_experts
        self.mine = plan.experts(E)
        self.local = local_expert_stack(cfg, moe.experts, self.mine)
        self.rank = plan.rank
        self.owner = (torch.arange(E) // len(self.mine)).to(moe.bias.device)  # expert → rank
        self.shared_owner = plan.shared_owner(layer)

    def forward(self, u: torch.Tensor, nx: Numerics) -> torch.Tensor:
        moe = self.moe
        shared = moe.shared is not None
        if shared and self.rank == self.shared_owner:
            # (as in MoE.forward: on a GPU the shared expert runs beside the routed experts)
            out, (idx, ys) = both(lambda: moe.shared.forward(u, nx),
                                  lambda: self.routed(u, nx), u.device)
            ys[:, idx.shape[1]] = out
        else:
            idx, ys = self.routed(u, nx)
        T, k = idx.shape
        every = self.comm.all_gather(ys)  # [W, T, k(+1), D]
        owner = self.owner[idx]
        if shared:
            owner = torch.cat((owner, owner.new_full((T, 1), self.shared_owner)), dim=1)
        ys = every.gather(0, owner[None, :, :, None].expand(1, T, k + shared, u.shape[1]))[0]
        # the slots in order, then the shared expert: MoE.forward's fp32 sums in its order
        # (the slots, then join's routed + shared) and its rounding, one launch on CUDA
        return slot_sum(ys, dtype=nx.act_dtype)

    def routed(self, u: torch.Tensor, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], slots [T, k (+1 for the shared expert), D] fp32): zero but
        for the pairs whose expert this rank holds."""
        moe = self.moe
        idx, w = moe.route(u, nx)
        T, k = idx.shape
        ys = torch.zeros((T, k + (moe.shared is not None), u.shape[1]), dtype=torch.float32,
                         device=u.device)
        lo, hi = self.mine.start, self.mine.stop
        ours = (idx >= lo) & (idx < hi)
        if T * k <= STATIC_PAIRS:
            # Decode steps and verify windows: every (token, slot) pair as its own row, with
            # static shapes — no host read of which pairs are ours, so the step has no host
            # wait and can be graphed. Other ranks' pairs borrow one of our selected experts
            # (its rows fill tiles that exist anyway, no extra weights read) and are ignored:
            # forward's gather takes every slot from its owner.
            local = idx - lo
            borrow = local.masked_fill(~ours, hi - lo).min().clamp(max=hi - lo - 1)
            local = torch.where(ours, local, borrow)
            ys[:, :k] = self.local.forward(u.repeat_interleave(k, dim=0), local.reshape(-1, 1),
                                           w.reshape(-1, 1), nx).view(T, k, -1)
        else:
            # Prefill chunks (eager, never graphed): only our pairs, as borrowed rows would
            # double the chunk's expert work; the host read costs little beside it.
            t, s = ours.nonzero(as_tuple=True)
            if t.numel():
                ys[t, s] = self.local.forward(u[t], (idx[t, s] - lo)[:, None],
                                              w[t, s][:, None], nx)
        return idx, ys


def apply_tp(model: Model, comm: Comm, plan: TPPlan) -> None:
    """Wire a model loaded through sharding_reader(plan) for its rank (in place)."""
    cfg = model.cfg
    heads, groups = plan.heads(cfg), plan.groups(cfg)
    for block in model.layers:
        if plan.attention == "heads":
            a = block.attn
            a.n_heads, a.n_groups = len(heads), len(groups)
            a.attn_sink = a.attn_sink[heads.start:heads.stop].clone()
            a.wo_a = a.wo_a.select(groups)
            a.wo_b = GatheredInput(comm, a.wo_b)
            if model.device.type == "cpu":
                a.attend_heads = _bind_padded(a, heads)
        block.ffn = ExpertParallelMoE(cfg, block.ffn, comm, plan, block.layer)


def _bind_padded(attn, heads: range):
    def attend(q, rows, mask, out=None, scratch=None):  # (scratch: CUDA's alone)
        return _padded_attend(attn, heads, q, rows, mask, out)
    return attend
