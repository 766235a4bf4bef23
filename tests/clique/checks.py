"""The arithmetic every clique must get right, shared by the CPU, GPU and subprocess tests."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import torch

from lampdist.clique import Clique, PendingCollective

from ._helpers import DTYPES, total, values


async def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Read back off the event loop: on CUDA the copy waits for the device, and the other
    # in-process ranks need the loop to queue their part of the collectives it waits for.
    host = await anyio.to_thread.run_sync(actual.cpu)
    assert actual.dtype == expected.dtype
    assert torch.equal(host, expected.cpu()), (actual, expected)


async def check_collectives(clique: Clique) -> None:
    """Every awaitable collective, several tensors of different dtypes at once."""
    n, rank, device = clique.nranks, clique.rank, clique.device

    tensors = [values(rank, 5 + i, dtype, device) for i, dtype in enumerate(DTYPES)]
    await clique.all_reduce(tensors)
    for i, (tensor, dtype) in enumerate(zip(tensors, DTYPES, strict=True)):
        await _same(tensor, total(n, 5 + i, dtype))

    for root in {0, n - 1}:
        tensors = [values(rank, 4 + i, dtype, device) for i, dtype in enumerate(DTYPES)]
        await clique.broadcast(tensors, root=root)
        for i, (tensor, dtype) in enumerate(zip(tensors, DTYPES, strict=True)):
            await _same(tensor, values(root, 4 + i, dtype, "cpu"))

        tensors = [values(rank, 3 + i, dtype, device) for i, dtype in enumerate(DTYPES)]
        await clique.reduce(tensors, root=root)
        if rank == root:  # the other ranks' tensors are scratch
            for i, (tensor, dtype) in enumerate(zip(tensors, DTYPES, strict=True)):
                await _same(tensor, total(n, 3 + i, dtype))

    for dtype in (torch.float32, torch.int64):
        chunk = 6
        output = torch.full((chunk,), -1, dtype=dtype, device=device)
        data = values(rank, n * chunk, dtype, device)
        await clique.reduce_scatter(output, data)
        await _same(output, total(n, n * chunk, dtype)[rank * chunk : (rank + 1) * chunk])
        await _same(data, values(rank, n * chunk, dtype, "cpu"))  # the input is left alone

        gathered = torch.full((n * chunk,), -1, dtype=dtype, device=device)
        await clique.all_gather(gathered, values(rank, chunk, dtype, device))
        await _same(gathered, torch.cat([values(peer, chunk, dtype, "cpu") for peer in range(n)]))

    empty = torch.empty(0, device=device)
    await clique.all_reduce([empty, values(rank, 2, torch.float32, device)])
    await clique.barrier()


async def check_started_collectives(clique: Clique) -> None:
    """The ``start_*`` forms: started back to back, some from a foreign thread, awaited later,
    one of them waited for from a worker thread."""
    n, rank, device = clique.nranks, clique.rank, clique.device
    summed = [values(rank, 7, torch.float32, device), values(rank, 3, torch.int64, device)]
    sent = [values(rank, 4, torch.float64, device)]
    reduced = [values(rank, 5, torch.int32, device)]
    scattered = torch.zeros(2, device=device)
    gathered = torch.zeros(2 * n, device=device)

    pending: list[PendingCollective] = [clique.start_all_reduce(summed)]

    def from_thread() -> None:  # like an autograd hook on torch's backward thread
        pending.append(clique.start_broadcast(sent, root=n - 1))
        pending.append(clique.start_reduce(reduced, root=0))

    thread = threading.Thread(target=from_thread)
    thread.start()
    thread.join()
    pending.append(
        clique.start_reduce_scatter(scattered, values(rank, 2 * n, torch.float32, device))
    )
    pending.append(clique.start_all_gather(gathered, values(rank, 2, torch.float32, device)))

    await anyio.to_thread.run_sync(pending[0].wait_blocking, 30.0)
    for each in pending:
        await each
    assert all(each.done() for each in pending)
    await pending[1].wait()  # waiting again returns at once

    await _same(summed[0], total(n, 7, torch.float32))
    await _same(summed[1], total(n, 3, torch.int64))
    await _same(sent[0], values(n - 1, 4, torch.float64, "cpu"))
    if rank == 0:
        await _same(reduced[0], total(n, 5, torch.int32))
    await _same(scattered, total(n, 2 * n, torch.float32)[2 * rank : 2 * rank + 2])
    await _same(gathered, torch.cat([values(peer, 2, torch.float32, "cpu") for peer in range(n)]))
