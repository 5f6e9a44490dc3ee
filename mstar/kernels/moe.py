"""The routed experts of a sparse MoE layer: hidden states x [T, H], stacked
SwiGLU experts (gate_up [E, 2I, H], gate rows then up rows; down [E, H, I])
and each token's routing (experts [T, k] ids, weights [T, k]) in; the sum of
each token's k weighted expert outputs [T, H] out, in x's dtype.

On CUDA it is four launches whatever the routing, none of which waits on the
host, so a decode step can be captured in a CUDA graph:

1. align: each expert's (token, slot) pairs, in token order, laid out in
   runs padded to a multiple of `block_m`, with the expert of every block.
   The grid is sized by the most blocks any routing can need, T*k plus
   (block_m - 1) padding for each expert that can be chosen; blocks past
   the routing's real count exit at once.
2. gate_up: one grouped GEMM over the blocks, each against its expert's
   gate and up rows, with silu(gate) * up in the epilogue, so the [slots, 2I]
   projection never reaches memory.
3. down: one grouped GEMM over the same blocks that scales each row by its
   routing weight and writes it to its (token, slot) row of [T, k, H].
4. a sum over k. Writing the k rows and summing them (rather than atomic
   float32 adds into [T, H]) keeps the result the same run to run, and
   needs no zeroed float32 buffer nor a cast after it; the extra traffic is
   T*k*H values, small next to the expert weights every step reads.

Roundings follow the reference: each expert's projections, silu(gate), the
activation and the weighted output are rounded to x's dtype as the unfused
torch ops round them; the k outputs are summed in float32 and rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mstar.kernels.activation import silu_and_mul_reference
from mstar.kernels.backend import block_size, cdiv, jit, tl, use_triton


@dataclass(frozen=True)
class Gemm:
    """One grouped GEMM's tile: output columns, reduction depth, warps and
    software-pipeline stages per program."""
    n: int
    k: int
    warps: int
    stages: int


@dataclass(frozen=True)
class MoeTiles:
    """Rows per block (every expert's run is padded to it) and the two GEMMs' tiles."""
    block_m: int
    gate_up: Gemm
    down: Gemm


# (most routed rows per expert on average, tiles), first match wins. A decode
# step gives most experts a row or two: 16-row blocks (the least tl.dot
# takes) waste the least on padding, and narrow tiles spread each expert's
# weights over many programs so the weight stream, the whole cost there,
# keeps the SMs busy: at one token the thinker's gate_up is 8 experts x 24
# column tiles (each covering 32 gate and 32 up columns), its down 8 x 32.
# Prefill blocks are taller so each weight tile loaded serves more rows.
TABLE: tuple[tuple[float, MoeTiles], ...] = (
    (16, MoeTiles(16, Gemm(32, 128, 4, 4), Gemm(64, 128, 4, 3))),
    (48, MoeTiles(32, Gemm(64, 128, 4, 3), Gemm(128, 128, 4, 3))),
    (float("inf"), MoeTiles(64, Gemm(64, 64, 4, 4), Gemm(128, 64, 4, 4))),
)

# routed rows the align step scans per loop iteration, and its warps: each
# of its programs walks every routed row twice, so a prefill's tens of
# thousands take wider steps to keep that walk short
ALIGN_CHUNKS = ((8192, 1024, 4), (float("inf"), 4096, 16))


def tiles_for(tokens: int, top_k: int, num_experts: int) -> MoeTiles:
    rows_per_expert = tokens * top_k / num_experts
    return next(t for most, t in TABLE if rows_per_expert <= most)


_COMPILED: set[tuple] = set()


def compile_variants(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> None:
    """Run the kernels once at every variant a step may need (each table row;
    routed-slot counts that are and are not multiples of 16, which Triton
    compiles apart; both align configs), so that no request waits for a
    compile. Once per shape class and dtype; nothing off CUDA."""
    if not use_triton(gate_up):
        return
    num_experts, width, hidden = gate_up.shape
    key = (gate_up.device, gate_up.dtype, num_experts, width, hidden, top_k)
    if key in _COMPILED:
        return
    # Triton compiles a slot count that is a multiple of 16 apart from one that is not: per table row
    # and align config, from its first token count on, one of each
    firsts = [1] + [int(most * num_experts / top_k) + 1 for most, _ in TABLE[:-1]]
    firsts += [int(limit) // top_k + 1 for limit, _, _ in ALIGN_CHUNKS[:-1]]
    tokens = set()
    for first in firsts:
        tokens.add(first)
        tokens.add(next(t for t in range(first, first + 17) if (t * top_k % 16 == 0) != (first * top_k % 16 == 0)))
    gen = torch.Generator(device=gate_up.device).manual_seed(0)
    for t in sorted(tokens):
        x = torch.randn(t, hidden, generator=gen, device=gate_up.device).to(gate_up.dtype)
        experts = torch.randint(0, num_experts, (t, top_k), generator=gen, device=gate_up.device)
        weights = torch.full((t, top_k), 1.0 / top_k, dtype=gate_up.dtype, device=gate_up.device)
        fused_moe_triton(x, gate_up, down, experts, weights)
    torch.cuda.synchronize(gate_up.device)
    _COMPILED.add(key)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return fused_moe_triton(x, gate_up, down, experts, weights)
    return fused_moe_reference(x, gate_up, down, experts, weights)


def fused_moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """One matmul pair per expert any token chose, in expert order."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        token, slot = (experts == e).nonzero(as_tuple=True)
        y = F.linear(silu_and_mul_reference(F.linear(x[token], gate_up[e])), down[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).float())
    return out.to(x.dtype)


def fused_moe_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """`tiles` overrides the table's choice (the tests reach every table row
    with small shapes this way)."""
    num_experts, width, hidden = gate_up.shape
    inter = width // 2
    t, top_k = experts.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x {tuple(x.shape)} is not [T, {hidden}] for gate_up {tuple(gate_up.shape)}")
    if width % 2 or down.shape != (num_experts, hidden, inter):
        raise ValueError(f"down {tuple(down.shape)} does not pair with gate_up {tuple(gate_up.shape)}"
                         f" (want [{num_experts}, {hidden}, {inter}])")
    if experts.shape != (x.shape[0], top_k) or weights.shape != experts.shape:
        raise ValueError(f"experts {tuple(experts.shape)} and weights {tuple(weights.shape)} are not"
                         f" [{x.shape[0]}, k] for x {tuple(x.shape)}")
    if t == 0:
        return torch.zeros_like(x)
    tiles = tiles or tiles_for(t, top_k, num_experts)
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_slots = t * top_k
    slots, block_expert, used = align_blocks(experts.reshape(-1), n_slots, num_experts, tiles.block_m)
    blocks = block_expert.shape[0]
    interpreted = not x.is_cuda
    precision = "ieee" if x.dtype == torch.float32 else "tf32"

    act = torch.empty(blocks * tiles.block_m, inter, dtype=x.dtype, device=x.device)
    g = tiles.gate_up
    _gate_up_kernel[(blocks * cdiv(inter, g.n),)](
        x, gate_up, act, slots, block_expert, used, n_slots, top_k, hidden, inter,
        x.stride(0), *gate_up.stride(), act.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=g.n, BLOCK_K=g.k, INTERPRETED=interpreted, PRECISION=precision,
        num_warps=g.warps, num_stages=g.stages)

    rows = torch.empty(n_slots, hidden, dtype=x.dtype, device=x.device)
    route = weights.reshape(-1)
    d = tiles.down
    _down_kernel[(blocks * cdiv(hidden, d.n),)](
        act, down, rows, route, slots, block_expert, used, n_slots, hidden, inter,
        act.stride(0), *down.stride(), rows.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=d.n, BLOCK_K=d.k, INTERPRETED=interpreted, PRECISION=precision,
        num_warps=d.warps, num_stages=d.stages)
    return rows.view(t, top_k, hidden).sum(dim=1)


def align_blocks(flat_experts: torch.Tensor, n_slots: int, num_experts: int,
                 block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, block_expert, used): slots[i] is the flat (token * k + j)
    index of the routed row at sorted position i, or n_slots on padding;
    block_expert[b] the expert of block b; used[0] the number of sorted
    positions in use (a multiple of block_m). Only the first used[0] slots and
    used[0] / block_m blocks are written."""
    # an expert gets block_m - 1 padding at most, and only experts chosen at all get any
    most = n_slots + min(num_experts, n_slots) * (block_m - 1)
    blocks = cdiv(most, block_m)
    device = flat_experts.device
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    ids = flat_experts if flat_experts.is_contiguous() else flat_experts.contiguous()
    chunk, warps = next((c, w) for most, c, w in ALIGN_CHUNKS if n_slots <= most)
    _align_kernel[(num_experts,)](ids, slots, block_expert, used, n_slots,
                                  BLOCK_M=block_m, BINS=max(block_size(num_experts), 32),
                                  CHUNK=chunk, num_warps=warps)
    return slots, block_expert, used


@jit
def _align_kernel(ids_ptr, slots_ptr, block_expert_ptr, used_ptr, n_slots,
                  BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    # program e places expert e's rows; every program counts all experts to
    # learn where e's run starts, which costs a second read of the ids but no
    # second launch nor a grid-wide barrier
    e = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, n_slots, CHUNK):
        live = start + lane < n_slots
        ids = tl.load(ids_ptr + start + lane, mask=live, other=0).to(tl.int32)
        # lanes past the end load expert 0: take them back out of its bin
        dead = CHUNK - tl.sum(live.to(tl.int32), axis=0)
        counts += tl.histogram(ids, BINS) - tl.where(bins == 0, dead, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    mine = bins == e
    run = tl.sum(tl.where(mine, padded, 0), axis=0)
    first = tl.sum(tl.where(mine, tl.cumsum(padded, axis=0) - padded, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    if e == 0:
        tl.store(used_ptr, tl.sum(padded, axis=0))

    # stable: rows keep token order within the run
    placed = count * 0
    for start in range(0, n_slots, CHUNK):
        ids = tl.load(ids_ptr + start + lane, mask=start + lane < n_slots, other=-1).to(tl.int32)
        hit = (ids == e).to(tl.int32)
        rank = placed + tl.cumsum(hit, axis=0) - 1
        tl.store(slots_ptr + first + rank, start + lane, mask=hit != 0)
        placed += tl.sum(hit, axis=0)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(slots_ptr + first + pad, n_slots, mask=pad < run)
    first_block = first // BLOCK_M
    n_blocks = run // BLOCK_M
    for b in range(0, n_blocks, CHUNK):
        tl.store(block_expert_ptr + first_block + b + lane, e, mask=b + lane < n_blocks)


@jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, slots_ptr, block_expert_ptr, used_ptr, n_slots, top_k, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_wk, stride_act,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    # block-major order: a block's column tiles run side by side, so the
    # blocks of one expert stream its weights through L2 together
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(inter, BLOCK_N)
    block = pid // n_tiles
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    live = slot < n_slots
    token = (slot // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    up_rows = inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_ptrs, mask=w_ok, other=0.0)
        wu = tl.load(w_ptrs + up_rows, mask=w_ok, other=0.0)
        if INTERPRETED:  # its dot would multiply bf16's raw bits
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = act_ptr.dtype.element_ty
    gate = _round(gate, dtype, INTERPRETED)
    act = _round(gate * tl.sigmoid(gate), dtype, INTERPRETED) * _round(up, dtype, INTERPRETED)
    # padding rows hold zeros (their x was masked to 0): the down GEMM may read them
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :],
             _round(act, dtype, INTERPRETED).to(dtype), mask=col_ok[None, :])


@jit
def _down_kernel(act_ptr, w_ptr, out_ptr, route_ptr, slots_ptr, block_expert_ptr, used_ptr, n_slots, hidden, inter,
                 stride_act, stride_we, stride_wn, stride_wk, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    block = pid // n_tiles
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    live = slot < n_slots
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_act + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERPRETED:  # its dot would multiply bf16's raw bits
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    route = tl.load(route_ptr + slot, mask=live, other=0.0).to(tl.float32)
    y = _round(_round(acc, dtype, INTERPRETED) * route[:, None], dtype, INTERPRETED)
    tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_out + cols[None, :], y.to(dtype),
             mask=live[:, None] & col_ok[None, :])


@jit
def _round(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 v rounded to dtype's precision, still float32. The interpreter
    truncates when it narrows to bf16; with the six roundings on a routed
    row's way that drifts past the tolerances, so there bf16's nearest-even
    rounding is done on the bits."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)
