"""The runner's transformer language model under PyTorch's DTensor tensor parallelism: the
side-by-side peer of `[wrap.mesh] tensor = T` (the runner's Megatron-style split, docs/parallelism.md).

    torchrun --standalone --nproc_per_node=W tp_torch.py FILE --tensor T [--sequence-parallel]
        [every fsdp2_torch.py option]

The data, the order of the windows, the optimizer recipe, the rows and RESULT.json are
fsdp2_torch.py's (its `train`); this script only spreads the model differently, as torchtitan's
parallelize_llama does, over one device mesh of W / T × T ranks, ("dp", "tp"):

- each block's q, k and v projections `ColwiseParallel` (rank r of the tensor group holds the rows
  of its query heads, and the same share of the key and value heads), the attention's output
  projection `RowwiseParallel` (the same heads' columns); the MLP's first layer `ColwiseParallel`,
  its last `RowwiseParallel` (`parallelize_module` over the "tp" dimension);
- the embeddings, the norms and the head replicated, as the runner's;
- with `--sequence-parallel` (the runner's `wrap.mesh.sequence_parallel`), torchtitan's sequence
  parallelism: the norms `SequenceParallel` (the activations between the split layers sharded
  along the sequence, Shard(1)), `PrepareModuleInput` gathering them into the attention and the
  embeddings' output sharded into the first block, the row-parallel layers' outputs Shard(1)
  (a reduce-scatter), the MLP's first layer gathering its Shard(1) input, the final norm's
  output gathered for the (replicated, untied) head;
- where W / T > 1, FSDP2 over "dp" (`fully_shard` on each block, then on the root: torchtitan's
  2-D FSDP × TP), each "dp" index reading its own shard of the data; the ranks of a tensor group
  read the same windows.

The runner's model (and transformer_torch.py's, whose weights INIT holds) fuses q, k and v into
one `qkv` matrix [q rows, k rows, v rows]. ColwiseParallel on it would give rank r a contiguous
block of rows (all q for r = 0 of 2): not its heads. So each block's `qkv` is cut into three
nn.Linear modules before the split, as torchtitan's Llama has them (wq, wk, wv). The MLP's `fc`
(GELU: one unit per row) splits as it is.

Gradient clipping measures the global norm of every whole gradient once: a DTensor's local part's
squares summed over the ranks it is sharded across, a replicated one's counted on each rank alone
(torch.nn.utils.clip_grad_norm_ does not take the mix of plain tensors and DTensors on different
meshes this layout has). Losses count once per tensor group (its rank 0's): every rank of the group
computes the same loss. `--precision bf16` is not built here.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp2_torch import Layout, arguments, train


def rows_of(linear, start, n):
    """An nn.Linear holding rows [start, start + n) of `linear`'s weight and bias."""
    part = nn.Linear(linear.in_features, n, bias=linear.bias is not None)
    with torch.no_grad():
        part.weight.copy_(linear.weight[start : start + n])
        if linear.bias is not None:
            part.bias.copy_(linear.bias[start : start + n])
    return part


class Attention(nn.Module):
    """The causal attention of a block's normed input, before its output projection: q, k and v
    as modules ColwiseParallel splits by heads. Each rank sees only its own heads: the head count
    of its q, k and v outputs follows from their width."""

    def __init__(self, qkv, heads):
        super().__init__()
        d = qkv.in_features
        self.head_dim = d // heads
        self.q, self.k, self.v = (rows_of(qkv, i * d, d) for i in range(3))

    def forward(self, h):
        # The whole sequence's shape (under sequence parallelism h is a DTensor gathered whole).
        b, t, _ = h.shape
        split = lambda y: y.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        return y.transpose(1, 2).reshape(b, t, -1)


class SplitBlock(nn.Module):
    """transformer_torch.py's Block with its fused qkv cut into q, k and v: the same function."""

    def __init__(self, block):
        super().__init__()
        self.ln1, self.proj, self.ln2, self.fc, self.out = block.ln1, block.proj, block.ln2, block.fc, block.out
        self.attn = Attention(block.qkv, block.heads)

    def forward(self, x):
        x = x + self.proj(self.attn(self.ln1(x)))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


# torchtitan's plan for a block: column-parallel into the heads and the hidden units, row-parallel out.
BLOCK_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "proj": RowwiseParallel(),
    "fc": ColwiseParallel(),
    "out": RowwiseParallel(),
}

# torchtitan's with sequence parallelism: the norms on Shard(1), gathered into the split layers,
# reduce-scattered out of them.
SEQUENCE_BLOCK_PLAN = {
    "ln1": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "proj": RowwiseParallel(output_layouts=Shard(1)),
    "ln2": SequenceParallel(),
    "fc": ColwiseParallel(input_layouts=Shard(1)),
    "out": RowwiseParallel(output_layouts=Shard(1)),
}


def sequence_parallel(model, tp):
    """Around the blocks: the embeddings' output sharded along the sequence into the first block,
    the final norm on the shards, its output gathered for the replicated head."""
    if model.head is None:
        raise SystemExit("tp_torch.py: --sequence-parallel takes an untied head")
    first = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    parallelize_module(model, tp, {"blocks.0": first, "ln_f": SequenceParallel(), "head": gather})


def global_norm_clip(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ over a model whose gradients are plain tensors (replicated)
    and DTensors (sharded over some of the mesh's dimensions): each whole gradient counted once."""
    world = dist.get_world_size()
    sums = {}  # the process group to sum over (None: none) -> this rank's sum of squares
    for p in params:
        g = p.grad
        if g is None:
            continue
        group = None
        if isinstance(g, DTensor):
            # Every dimension it is not replicated over: Shard, and FSDP2's _StridedShard of a
            # tensor-parallel parameter (whose is_shard() is False).
            dims = [i for i, placement in enumerate(g.placements) if not placement.is_replicate()]
            if len(dims) == 1:
                group = g.device_mesh.get_group(dims[0])
            elif dims:
                if g.device_mesh.size() != world:
                    raise SystemExit("tp_torch.py: a gradient sharded over a part of a mesh that is not the world")
                group = dist.group.WORLD
            g = g.to_local()
        sums[group] = sums.get(group, 0.0) + g.detach().double().square().sum()
    total = torch.zeros((), dtype=torch.float64)
    for group, s in sums.items():
        if group is not None:
            dist.all_reduce(s, group=group)
        total += s
    norm = math.sqrt(total.item())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def tensor_parallel(model, a):
    """The model's blocks split over the mesh's "tp" dimension, FSDP2 over "dp" where it has more
    than one index; the embeddings, the norms and the head replicated."""
    world = dist.get_world_size()
    if a.tensor < 1 or world % a.tensor:
        raise SystemExit(f"tp_torch.py: --tensor {a.tensor} does not divide the world size {world}")
    if a.heads % a.tensor or (4 * a.d_model) % a.tensor:
        raise SystemExit(f"tp_torch.py: --tensor {a.tensor} does not divide the heads ({a.heads}) and MLP units")
    if a.precision != "fp32":
        raise SystemExit("tp_torch.py: --precision bf16 is not built")
    data = world // a.tensor
    mesh = init_device_mesh("cpu", (data, a.tensor), mesh_dim_names=("dp", "tp"))
    model.blocks = nn.ModuleList(SplitBlock(b) for b in model.blocks)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], SEQUENCE_BLOCK_PLAN if a.sequence_parallel else BLOCK_PLAN)
    if a.sequence_parallel:
        sequence_parallel(model, mesh["tp"])
    units = [f"blocks.{i}: q, k, v, fc column-parallel; proj, out row-parallel" for i in range(len(model.blocks))]
    if data > 1:
        reshard = a.reshard_after_forward == "true"
        last = len(model.blocks) - 1
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard and i < last)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    tp_rank = mesh["tp"].get_local_rank()
    extra = {"mesh": {"data": data, "tensor": a.tensor}, "sequence_parallel": a.sequence_parallel}
    extra["precision"] = a.precision
    return Layout(units, mesh["dp"].get_local_rank(), data, tp_rank == 0, global_norm_clip, extra)


def main():
    p = arguments()
    p.add_argument("--tensor", type=int, required=True, help="ranks each block is split across")
    p.add_argument("--sequence-parallel", action="store_true", help="torchtitan's sequence parallelism")
    a = p.parse_args()
    train(a, lambda model: tensor_parallel(model, a), "tp_torch.py")


if __name__ == "__main__":
    main()
