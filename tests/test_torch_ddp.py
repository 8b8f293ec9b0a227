"""OffloadedAdam under DistributedDataParallel (gloo, two CPU processes)."""

import datetime
import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_one(optimizer, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if optimizer == "torch":
        opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    else:
        from rtmem.torch import OffloadedAdam
        if optimizer == "default":
            opt = OffloadedAdam(ddp.parameters(), lr=0.1)
            # two ranks in the group: the default keeps the gradients in p.grad
            assert opt.flush_in_backward is False
        else:
            opt = OffloadedAdam(ddp.parameters(), lr=0.1,
                                flush_in_backward=optimizer == "flush-in-backward")
    gen = torch.Generator().manual_seed(100 + rank)      # each rank its own data
    for _ in range(3):
        for _ in range(2):                               # two micro-batches
            x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
            ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    # numpy arrays go by value (a tensor would go as shared memory that the
    # exiting child takes with it)
    return [p.detach().numpy().copy() for p in model.parameters()]


def _rank(rank, port, optimizers, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RTMEM_BACKEND="host")
    # a collective that waits for a dead peer fails after the timeout, not never
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        # every optimizer in one pair of processes: spawning one (and importing
        # torch in it) costs seconds, the training itself milliseconds
        queue.put((rank, {o: _train_one(o, rank) for o in optimizers}, None))
    except Exception as exc:       # reported to the test, not lost in a child
        queue.put((rank, None, repr(exc)))
    finally:
        dist.destroy_process_group()


def _train(*optimizers):
    """Parameters after training under DDP, per optimizer: {name: (rank 0, rank 1)}."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, optimizers, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (params, err)) for r, params, err in
                       (queue.get(timeout=180) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r, (_, err) in results.items():
        assert err is None, f"rank {r}: {err}"
    return {o: tuple([torch.from_numpy(a) for a in results[r][0][o]] for r in (0, 1))
            for o in optimizers}


def test_offloaded_adam_under_ddp_needs_gradients_left_in_p_grad():
    # DDP's reducer all-reduces p.grad in a hook that runs after OffloadedAdam's
    # gradient hook: flushed in backward, the gradient was gone, DDP averaged
    # zeros and each rank stepped with its own gradient. flush_in_backward=False
    # (the default in a process group of two) leaves p.grad to DDP; step()
    # takes the averaged one.
    trained = _train("torch", "default", "flush-in-backward")
    ref, ref1 = trained["torch"]
    assert all(torch.equal(a, b) for a, b in zip(ref, ref1))
    mine, mine1 = trained["default"]
    assert all(torch.equal(a, b) for a, b in zip(mine, mine1))      # ranks agree
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    diverged = trained["flush-in-backward"]                         # the failure mode
    assert any(not torch.equal(a, b) for a, b in zip(*diverged))
