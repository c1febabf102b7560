"""Times gloo's reduce-scatter (libtorch's ProcessGroupGloo, the one the runner links: an all-reduce
of the whole input, then the rank's slice) against a ring reduce-scatter over gloo's send/recv
(world - 1 steps, each sending and receiving one chunk) and against one all-to-all followed by a
local sum (the same bytes as the ring, in one collective), on CPU tensors of the sizes an FSDP unit's
gradients have. Both give the same sums (a ring adds the chunks in another order).

    .deps/reference/bin/torchrun --standalone --nproc_per_node=2 benches/reference/reduce_scatter.py \
        --mib 1 4 16 --repeat 20
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def ring_reduce_scatter(out, inp, world, rank, chunk):
    """Rank r ends with chunk r of the sum; chunks flow from rank r - 1 to rank r + 1."""
    parts = inp.view(world, chunk)
    send = parts[(rank - 1) % world].clone()
    recv = torch.empty(chunk, dtype=inp.dtype)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        send = recv + parts[(rank - s - 2) % world]
    out.copy_(send)


def alltoall_reduce_scatter(out, inp, world, chunk):
    """Every rank sends chunk j to rank j (one all-to-all), then sums the chunks it received."""
    got = torch.empty_like(inp)
    dist.all_to_all_single(got, inp)
    torch.sum(got.view(world, chunk), 0, out=out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=float, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    for mib in a.mib:
        chunk = int(mib * 2**20 / 4 / world)
        inp = torch.randn(world * chunk, generator=torch.Generator().manual_seed(rank))
        out_gloo, out_ring, out_a2a = torch.empty(chunk), torch.empty(chunk), torch.empty(chunk)
        times = {"gloo": [], "ring": [], "alltoall": []}
        for i in range(a.repeat + 2):
            for name, f in [
                ("gloo", lambda: dist.reduce_scatter_tensor(out_gloo, inp)),
                ("ring", lambda: ring_reduce_scatter(out_ring, inp, world, rank, chunk)),
                ("alltoall", lambda: alltoall_reduce_scatter(out_a2a, inp, world, chunk)),
            ]:
                dist.barrier()
                t = time.perf_counter()
                f()
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
        same = all(torch.allclose(out_gloo, o, rtol=1e-5, atol=1e-5) for o in (out_ring, out_a2a))
        if rank == 0:
            med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
            print(f"{mib:g} MiB input, {world} ranks: gloo reduce-scatter {med['gloo']:.2f} ms, "
                  f"ring over send/recv {med['ring']:.2f} ms, all-to-all then a sum {med['alltoall']:.2f} ms "
                  f"(median of {a.repeat}; same sums: {same})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
