import os, socket, sys, traceback
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def _worker(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except Exception:
        print(f"[rank{rank}] EXC\n" + traceback.format_exc(), flush=True)
        raise
    finally:
        dist.destroy_process_group()

def launch(fn, world=4, args=()):
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)

def rprint(rank, *a):
    print(f"[r{rank}]", *a, flush=True)
